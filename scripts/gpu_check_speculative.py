"""GPU check of lesson 10: speculative decoding on CUDA (SmolLM2-135M target, bfloat16 and float32).

    python scripts/gpu_check_speculative.py      # writes $OUT/speculative.json (default results/gpu/speculative.json)

Measures what the CPU bench cannot show: the verify cost of a forward over q = 1..33 tokens on a GPU (memory bound:
it should stay near one decode step), prompt lookup and early-exit / student drafts against target-only greedy with
token-identical output, and the engine's throughput at batch 1/4/16 with and without prompt-lookup speculation.
The issue's GPU target: the distilled student >= 2x on chat prompts (only when the student is in the cache folder).
Without CUDA it writes a 'skipped' report.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing


def check(dtype: str) -> dict:
    import minillm
    from minillm.bench.speculative import STUDENT, engine_throughput, timed, verify_cost, workloads
    from minillm.gguf.saved import saved_model_dir
    from minillm.speculative.decoding import SpeculativeConfig

    model, tok = minillm.load_model(dtype=dtype, device="cuda")
    b = {"n_grounded": 3, "n_chat": 4, "n_text": 0}
    loads = workloads(tok, b)
    variants = [("ngram", SpeculativeConfig("ngram", k=k)) for k in (4, 8)]
    variants += [(f"early exit {n}", SpeculativeConfig("early_exit", k=2, exit_layer=n)) for n in (10, 20)]
    if saved_model_dir(STUDENT).exists():
        variants += [("student", SpeculativeConfig("draft", k=k, draft_model=STUDENT)) for k in (2, 4, 6)]
    rows, identical = [], True
    for name, spec in variants:
        for load, prompts in loads.items():
            tb = ts = 0.0
            acc = []
            for ids, _ in prompts:
                ref, t1, _ = timed(model, tok, ids, 64)
                out, t2, st = timed(model, tok, ids, 64, spec)
                identical &= out == ref
                tb, ts = tb + t1, ts + t2
                acc.append(st.acceptance_rate)
            rows.append({"draft": name, "k": spec.k, "workload": load, "acceptance": sum(acc) / len(acc),
                         "speedup": tb / ts, "target_tok_s": 64 * len(prompts) / tb})
            print(dtype, rows[-1], flush=True)
    cost = verify_cost(model, [1, 2, 3, 5, 9, 17, 33])
    print(dtype, "verify cost", [(c["q_tokens"], round(c["vs_decode"], 2)) for c in cost], flush=True)
    engine = []
    grounded = [ids for ids, _ in loads["grounded"]]
    for batch in (1, 4, 16):
        plain, ref = engine_throughput(model, tok, grounded, batch, 64, None)
        spec_tps, outs = engine_throughput(model, tok, grounded, batch, 64, SpeculativeConfig("ngram", k=4,
                                                                                              max_batch=batch))
        engine.append({"batch": batch, "plain_tok_s": plain, "spec_tok_s": spec_tps, "speedup": spec_tps / plain,
                       "identical": outs == ref})
        print(dtype, engine[-1], flush=True)
    return {"rows": rows, "verify_cost": cost, "engine": engine, "greedy_identical": identical}


def main() -> None:
    out = Path(os.environ.get("OUT", ROOT / "results" / "gpu"))
    out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        report = {"skipped": "no CUDA device"}
    else:
        report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        for dtype in ("bfloat16", "float32"):
            try:
                report[dtype] = check(dtype)
            except Exception:  # the report says what failed; the rest of gpu_check.sh still runs
                report[dtype] = {"error": traceback.format_exc()}
                print(report[dtype]["error"])
    (out / "speculative.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {out / 'speculative.json'}")


if __name__ == "__main__":
    main()
