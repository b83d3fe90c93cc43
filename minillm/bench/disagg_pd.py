"""Part "pd" of `minillm bench disagg` (lesson 13): prefill/decode interference, colocated vs disaggregated.

The chunked-prefill bench's workload (chat requests decoding while long prompts arrive), SmolLM2-135M,
float32, greedy, served three ways on 2 x `threads` cores in all: one colocated LLM whose step holds a whole
prompt; the same chunked at 64 tokens a step (Sarathi); minillm.cluster.disagg.DisaggregatedLLM, a prefill and
a decode worker, the KV moved over gloo. Per mode: TTFT, the chat requests' TPOT and ITL, goodput under an
SLO; for disaggregated, the KV bytes moved per prompt token against the formula and the transfer's share of
TTFT. Outputs compared.
"""

from __future__ import annotations

import math

import torch

from minillm.bench.chunked_prefill import mixed_workload
from minillm.measure.metrics import percentiles, summarize, timer
from minillm.measure.workload import serve


def _row(mode: str, outs, wall: float, n_decode: int, slo: tuple[float, float]) -> dict:
    decodes, longs = outs[:n_decode], outs[n_decode:]
    s = summarize(outs, wall, *slo)
    tpot = percentiles([o.metrics["tpot"] for o in decodes], (50, 99))
    itl = percentiles([g for o in decodes for g in o.metrics["itl"]], (50, 99))
    return {"mode": mode, "ttft_p50_s": s["ttft_p50"], "ttft_p99_s": s["ttft_p99"],
            "decode_tpot_p50_s": tpot["p50"], "decode_tpot_p99_s": tpot["p99"],
            "decode_itl_p50_s": itl["p50"], "decode_itl_p99_s": itl["p99"],
            "decode_itl_max_s": max((g for o in decodes for g in o.metrics["itl"]), default=math.nan),
            "long_ttft_mean_s": sum(o.metrics["ttft"] for o in longs) / max(1, len(longs)),
            "goodput_req_per_s": s["goodput_req_per_s"], "slo_attained": s["slo_attained"],
            "output_tok_per_s": s["output_tok_per_s"], "wall_s": wall}


def measure(quick: bool, threads: int = 1, colocated_threads: int | None = None) -> dict:
    """Run the three modes back to back; rows, ratios, targets, notes, series (and settings). colocated_threads
    (default 2 x threads: the same cores) can be lowered where other work occupies cores: with more torch threads
    than free cores a step can slow down many-fold (spin-waiting threads), which would flatter disaggregation."""
    from minillm.cluster.disagg import DisaggregatedLLM
    from minillm.engine import LLM
    from minillm.api import load_model
    from minillm.measure.hardware import load_average

    if quick:
        n_decode, decode_len, n_long, long_len, gap, first = 2, 24, 2, 200, 0.6, 0.3
    else:
        n_decode, decode_len, n_long, long_len, gap, first = 4, 64, 3, 1000, 2.0, 0.5
    before = torch.get_num_threads()
    colocated_threads = 2 * threads if colocated_threads is None else colocated_threads
    load_before = load_average()
    torch.set_num_threads(colocated_threads)  # colocated: one engine gets all the cores the two workers share
    model, tok = load_model("smollm2-135m", dtype="float32", device="cpu")
    reqs = mixed_workload(tok, n_decode, decode_len, n_long, long_len, gap, first)
    no_chunk = long_len + n_decode + 64
    warm = [r.prompt_ids for r in reqs[:2]], [r.params() for r in reqs[:2]]
    runs = {}
    try:
        LLM.from_model(model, tok).generate(*warm)
        for mode, budget in (("colocated", no_chunk), ("colocated_chunked_64", 64)):
            llm = LLM.from_model(model, tok, max_num_seqs=16, max_num_batched_tokens=budget)
            runs[mode] = serve(llm, reqs)
        torch.set_num_threads(1)  # the coordinator only waits on queues
        engine = {"max_num_seqs": 16, "max_num_batched_tokens": no_chunk}
        with timer() as startup:
            d = DisaggregatedLLM("smollm2-135m", threads=threads, prefill=engine, decode=engine,
                                 timeout_s=300)
        startup_s = startup.seconds
        with d:
            d.generate(*warm)
            runs["disaggregated_1+1"] = d.serve(reqs)
            transfers = d.stats()["requests"][-len(reqs):]
    finally:
        torch.set_num_threads(before)

    base = runs["colocated"][0]
    # SLO from the undisturbed colocated run: TPOT within 2x its median decode step, TTFT within 2x its long-prompt
    # TTFT (a whole 2-core prefill). Disaggregated prefill has half the cores: its TTFT is the price it pays.
    slo_tpot = 2 * percentiles([g for o in base[:n_decode] for g in o.metrics["itl"]], (50,))["p50"]
    slo_ttft = 2 * percentiles([o.metrics["ttft"] for o in base[n_decode:]], (50,))["p50"]
    rows = [_row(mode, outs, wall, n_decode, (slo_ttft, slo_tpot)) for mode, (outs, wall) in runs.items()]
    cfg = model.config
    formula = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4  # K and V, every layer, float32
    longs = transfers[n_decode:]
    dis = rows[-1]
    dis.update({
        "kv_bytes_per_prompt_token": sum(t["transfer_bytes"] for t in transfers)
        / sum(t["prompt_tokens"] for t in transfers),
        "kv_bytes_per_token_formula": formula,
        "transfer_s_mean": sum(t["transfer_s"] for t in transfers) / len(transfers),
        "long_transfer_s_mean": sum(t["transfer_s"] for t in longs) / len(longs),
        "long_transfer_share_of_ttft": sum(t["transfer_share_of_ttft"] for t in longs) / len(longs),
        "startup_s": startup_s})
    ref = [o.token_ids for o in base]
    equal = {mode: sum(o.token_ids == r for o, r in zip(outs, ref)) for mode, (outs, _) in runs.items()}
    col, chk = rows[0], rows[1]
    ratios = {
        "tpot_p99_colocated_vs_disagg": col["decode_tpot_p99_s"] / dis["decode_tpot_p99_s"],
        "itl_p99_colocated_vs_disagg": col["decode_itl_p99_s"] / dis["decode_itl_p99_s"],
        "tpot_p99_chunked_vs_disagg": chk["decode_tpot_p99_s"] / dis["decode_tpot_p99_s"],
        "long_ttft_disagg_vs_colocated": dis["long_ttft_mean_s"] / col["long_ttft_mean_s"],
        "throughput_disagg_vs_colocated": dis["output_tok_per_s"] / col["output_tok_per_s"],
    }
    targets = {"tpot_p99_colocated_vs_disagg": (">=", 2.0)}
    notes = [
        (f"{n_decode} requests of 32 prompt tokens decode {decode_len} tokens each from t=0; {n_long} prompts of "
         f"{long_len} tokens (4 output tokens) arrive at t = {first} s + {gap} s apart; float32; greedy; CPU; "
         f"{colocated_threads} threads colocated, {threads} + {threads} disaggregated (+ an idle coordinator); "
         f"load average before/after: {load_before} / {load_average()} (other work on the machine distorts both)."),
        (f"SLO: TTFT <= {slo_ttft:.2f} s and TPOT <= {slo_tpot:.3f} s (2x the colocated run's long-prompt TTFT and "
         f"median decode step)."),
        (f"KV moved: {dis['kv_bytes_per_prompt_token']:.0f} B per prompt token (whole blocks) vs the formula "
         f"2 x {cfg.n_layers} layers x {cfg.n_kv_heads} kv heads x {cfg.head_dim} x 4 B = {formula} B; long prompt "
         f"transfer {dis['long_transfer_s_mean'] * 1e3:.0f} ms, {dis['long_transfer_share_of_ttft']:.1%} of its TTFT."),
        (f"greedy outputs equal to the colocated run's, per mode (of {len(reqs)}): {equal}. Chunking and batching "
         f"change float summation order; a near-tie can then round the other way."),
        ("TTFT/TPOT for disaggregated are measured on the coordinator's clock from submission; the first token reaches "
         "the caller from the decode worker, so TTFT includes the KV transfer. Colocated metrics use the engine's "
         "timestamps (no inter-process hop)."),
        (f"the disaggregated workers' startup ({startup_s:.1f} s: two processes load the model) is not timed."),
    ]
    series = {"mode": [r["mode"] for r in rows],
              "decode_tpot_p99_s": [r["decode_tpot_p99_s"] for r in rows],
              "decode_itl_p99_s": [r["decode_itl_p99_s"] for r in rows],
              "long_ttft_mean_s": [r["long_ttft_mean_s"] for r in rows],
              "decode_token_times_s": {mode: [o.token_times for o in outs[:n_decode]] for mode, (outs, _) in
                                       runs.items()}}
    settings = {"quick": quick, "threads": threads, "colocated_threads": colocated_threads, "decodes": n_decode,
                "decode_len": decode_len,
                "long_prompts": n_long, "long_len": long_len, "gap_s": gap, "first_s": first,
                "chunk_budget": 64, "no_chunk_budget": no_chunk, "slo_ttft_s": slo_ttft, "slo_tpot_s": slo_tpot,
                "outputs_equal": equal}
    return {"rows": rows, "ratios": ratios, "targets": targets, "notes": notes, "series": series,
            "settings": settings}


if __name__ == "__main__":
    import json
    import sys

    res = measure(quick="--full" not in sys.argv,
                  colocated_threads=int(sys.argv[sys.argv.index("--colocated-threads") + 1])
                  if "--colocated-threads" in sys.argv else None)
    print(json.dumps({k: res[k] for k in ("rows", "ratios", "targets", "notes", "settings")}, indent=1,
                     default=str))
