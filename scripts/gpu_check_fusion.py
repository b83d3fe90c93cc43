"""GPU check of lesson 06: eager vs fused vs compiled (CUDA graphs, mode="reduce-overhead") batch-1 decode.

    python scripts/gpu_check_fusion.py          # writes $OUT/gpu_check_fusion.json (or results/gpu_check_fusion.json)

SmolLM2-135M in bfloat16 on CUDA (weights from the minillm cache; the device machine has no network), greedy, 128 new
tokens after a 32-token prompt: decode tok/s of each variant, compile time apart, greedy tokens compared with eager.
Target (issue: fusion/compile): CUDA-graph decode >= 3x eager at batch 1. Without CUDA it writes a 'skipped' report.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing


def main() -> int:
    base = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "results"
    base.mkdir(parents=True, exist_ok=True)
    path = base / "gpu_check_fusion.json"
    report: dict = {"script": "gpu_check_fusion", "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    if not torch.cuda.is_available():
        report["skipped"] = "no CUDA device: run this on a GPU machine"
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(report["skipped"])
        return 0
    try:
        import minillm
        from minillm.compile.fusion import fuse

        model, tok = minillm.load_model("smollm2-135m", dtype="bfloat16", device="cuda")
        ids = tok.encode("The history of the printing press begins with " * 8)[:32]
        report["gpu"] = torch.cuda.get_device_name()

        def run(m, compile):
            minillm.generate(m, tok, ids, max_new_tokens=8, ignore_eos=True, compile=compile)  # warm-up / compile
            outs = [minillm.generate(m, tok, ids, max_new_tokens=128, ignore_eos=True, compile=compile)
                    for _ in range(3)]
            return sorted(o.decode_tokens_per_s for o in outs)[1], outs[0].token_ids

        results = {"eager": run(model, False)}
        fused = fuse(model)
        results["fused"] = run(fused, False)
        t0 = time.perf_counter()
        results["compiled (reduce-overhead: CUDA graphs)"] = run(fused, True)
        report["compile_and_first_run_s"] = time.perf_counter() - t0
        eager_tok_s, eager_ids = results["eager"]
        report["tok_s"] = {k: v[0] for k, v in results.items()}
        report["same_tokens_as_eager"] = {k: v[1] == eager_ids for k, v in results.items()}
        report["compiled_vs_eager"] = results["compiled (reduce-overhead: CUDA graphs)"][0] / eager_tok_s
        report["target_met"] = report["compiled_vs_eager"] >= 3.0
    except Exception:  # noqa: BLE001 - the report records it; the other GPU checks still run
        report["error"] = traceback.format_exc()
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
