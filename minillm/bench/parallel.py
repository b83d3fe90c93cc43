"""`minillm bench parallel` (lesson 11): tensor, sequence and pipeline parallelism against one process.

SmolLM2-135M, float32, greedy, gloo ranks of one torch thread each (quick mode: a tiny random model). On a
2-core CPU the ranks share the cores, so no split beats one process: the bench measures how much they lose and
the share spent in collectives. It verifies the single process's tokens in every configuration, the bytes each
collective moved against the formula, the pipeline bubble against (p - 1) / (m + p - 1), and models
(analytically, labelled so) what TP would cost for Llama-2-7B/70B on 8 GPUs over NVLink and over PCIe.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minillm.measure.harness import BenchResult
from minillm.measure.metrics import decode_rate, timed_decode

# the analytic model's links: (GB/s per GPU one way, microseconds per small all-reduce), rough public figures
LINKS = {"NVLink 4 (H100 SXM)": (450.0, 8.0), "PCIe 4.0 x16": (25.0, 25.0)}


def rank_bubble(rank: int, world_size: int, spec, prompt_ids: list[int], micro: list[int]) -> list[dict]:
    """Prefill the same prompt through a pipeline with each micro-batch count; the measured bubble of each."""
    from minillm.parallel.distributed import Comm
    from minillm.gguf.loader import load_spec
    from minillm.parallel.pipeline import PipelineStage, StageCache, measured_bubble, pipeline_prefill

    model = load_spec(spec)[0]
    stage = PipelineStage(model, Comm(), len(prompt_ids))
    ids = torch.tensor([prompt_ids])
    out = []
    with torch.inference_mode():
        for m in [micro[0], *micro]:  # the first run warms up (allocations, first sends)
            stage.cache = StageCache(model, stage.start, stage.end, len(prompt_ids))
            stage.events = []
            dist.barrier()
            pipeline_prefill(stage, ids, m)
            events = [None] * world_size
            dist.all_gather_object(events, stage.events)
            out.append({"micro_batches": m, "measured": measured_bubble(events), "events": events})
    return out[1:]


def analytic_tp(cfg, name: str, tp: int = 8, batch: int = 1, context: int = 4096, dtype_bytes: int = 2) -> list[dict]:
    """Labelled model, not a measurement: memory per device and all-reduce traffic per decode step under TP."""
    weights = cfg.n_params() * dtype_bytes
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype_bytes * context * batch
    per_step = 2 * cfg.n_layers * batch * cfg.dim * dtype_bytes  # two all-reduces of (batch, dim) per block
    ring = 2 * (tp - 1) / tp * per_step
    rows = []
    for link, (gbps, latency_us) in LINKS.items():
        comm_s = 2 * cfg.n_layers * latency_us * 1e-6 + ring / (gbps * 1e9)  # latency of each + bytes / bandwidth
        rows.append({"model": name, "tp": tp, "batch": batch, "link": link, "weights_GB_per_device": weights / tp / 1e9,
                     "kv_GB_per_device": kv / tp / 1e9, "allreduce_MB_per_step": ring / 1e6,
                     "comm_ms_per_step": comm_s * 1e3,
                     "hbm_read_ms_per_step": (weights + kv) / tp / 3.35e12 * 1e3})  # H100 HBM3 ~3.35 TB/s
    return rows


def single_process(spec, ids: list[int], n: int, threads: int) -> tuple[list[int], float]:
    """Greedy ids and decode tokens/s of `n` new tokens in this process, with `threads` torch threads."""
    from minillm.gguf.loader import load_spec

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = load_spec(spec)[0]
        timed_decode(model, ids[:8], 2)  # warm-up
        out = timed_decode(model, ids, n)
        return out.token_ids, decode_rate(out.token_times)
    finally:
        torch.set_num_threads(before)


def run(quick: bool = False) -> BenchResult:
    from minillm.config import LLAMA2_7B, LLAMA2_70B
    from minillm.gguf.loader import load_spec
    from minillm.parallel.launch import generate_parallel
    from minillm.sampling import SamplingParams
    from minillm.parallel.pipeline import bubble_fraction
    from minillm.parallel.sequence import residual_bytes
    from minillm.parallel.tensor import TPPlan, tp_bytes_per_token

    if quick:
        spec = {"tiny": {"n_layers": 6, "n_heads": 6, "n_kv_heads": 3, "dim": 96, "ffn_dim": 192, "vocab_size": 384,
                         "max_seq_len": 512}, "seed": 0}
        configs, n, prompt_len, micro = [{"tp": 3}, {"pp": 2}], 8, 48, [1, 4]
    else:
        spec, configs, n, prompt_len, micro = "smollm2-135m", [{"tp": 2}, {"tp": 3}, {"tp": 3, "sp": True},
                                                               {"pp": 2}, {"pp": 3}], 64, 96, [1, 2, 4, 8]
    cfg = load_spec(spec)[0].config
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (256,), generator=gen).tolist()
    prompt = ids[:prompt_len]
    ref, tok_s_1 = single_process(spec, prompt, n, 1)
    _, tok_s_2 = single_process(spec, prompt, n, 2)
    rows = [{"config": "1 process, 1 thread", "ranks": 1, "decode_tok_s": tok_s_1, "identical": True},
            {"config": "1 process, 2 threads", "ranks": 1, "decode_tok_s": tok_s_2, "identical": True}]
    exact, identical = True, True
    for c in configs:
        (out,) = generate_parallel(spec, [prompt], SamplingParams(max_tokens=n, ignore_eos=True), threads=1,
                                   timeout_s=120, **c)
        res = out.metrics  # rank 0's timings and collective counts; "ranks": every rank's
        p = c.get("tp", 1) * c.get("pp", 1)
        comm, steps = res["comm_decode"], res["decode_steps"]
        row = {"config": ", ".join(f"{k}={v}" for k, v in c.items()), "ranks": p,
               "decode_tok_s": res["decode_tok_s"], "identical": out.token_ids == ref,
               "prefill_ms": res["prefill_s"] * 1e3, "comm_share": res["comm_decode_s"] / res["decode_s"]}
        if "tp" in c:
            plan = TPPlan.for_config(cfg, c["tp"])
            formula = tp_bytes_per_token(cfg, plan)
            measured = {op: comm[op]["bytes"] / steps for op in ("all_reduce", "all_gather")}
            row["allreduce_KiB_per_token"] = measured["all_reduce"] / 1024
            row["bytes_vs_formula"] = sum(measured.values()) / sum(formula.values())
            ring_ok = abs(comm["all_reduce"]["ring_bytes"] - 2 * (p - 1) / p * comm["all_reduce"]["bytes"]) < 1e-6
            exact &= measured == formula and ring_ok
        else:
            sends = sum(r["comm_decode"].get("send", {}).get("bytes", 0) for r in res["ranks"]) / steps
            row["send_KiB_per_token"] = sends / 1024
            row["bytes_vs_formula"] = sends / ((p - 1) * cfg.dim * 4)  # one (1, 1, dim) float32 per stage boundary
            exact &= row["bytes_vs_formula"] == 1.0
        identical &= row["identical"]
        rows.append(row)
        print(f"  {row['config']:<12} {row['decode_tok_s']:6.1f} tok/s, comm {row['comm_share']:.0%}", flush=True)

    from minillm.parallel.distributed import launch

    bubbles = []
    for p in ([2] if quick else [2, 3]):
        for r in launch(rank_bubble, p, spec, ids[:256 if not quick else 96], micro, threads=1, timeout_s=120)[0]:
            bubbles.append({"stages": p, "micro_batches": r["micro_batches"], "measured_bubble": r["measured"],
                            "formula_bubble": bubble_fraction(p, r["micro_batches"]), "events": r["events"]})
    sp_saving = residual_bytes(cfg, prompt_len, 3, False) / residual_bytes(cfg, prompt_len, 3, True)
    analytic = []
    for name, big in (("Llama-2-7B", LLAMA2_7B), ("Llama-2-70B", LLAMA2_70B)):
        for batch in (1, 64):
            analytic += analytic_tp(big, name, 8, batch)
    best_parallel = max(r["decode_tok_s"] for r in rows if r["ranks"] > 1)
    best_single = max(tok_s_1, tok_s_2)  # on a shared machine a second OpenMP thread can lose to one
    worst_bubble = max(abs(b["measured_bubble"] - b["formula_bubble"]) for b in bubbles if b["micro_batches"] > 1)
    ratios = {"tokens_identical": float(identical), "collective_bytes_equal_formula": float(exact),
              "best_parallel_vs_best_one_process": best_parallel / best_single,
              "pp_bubble_max_abs_error": worst_bubble, "sp_residual_memory_saving": sp_saving}
    targets = {"tokens_identical": (">=", 1.0), "collective_bytes_equal_formula": (">=", 1.0)}
    if not quick:  # a tiny model's micro-batches are all latency: its bubble says nothing about the schedule
        targets["pp_bubble_max_abs_error"] = ("<=", 0.1)
    notes = ["ranks share this machine's cores: parallel ranks cannot beat one process using them all; the analytic "
             "rows are a model (public bandwidth figures), not a measurement",
             "pipeline micro-batches are consecutive chunks of one prompt; decode sends one token's hidden state "
             "through every stage per step"]
    return BenchResult(name="parallel", rows=rows, ratios=ratios, targets=targets,
                       settings={"model": spec if isinstance(spec, str) else "tiny random", "new_tokens": n,
                                 "prompt_tokens": prompt_len, "threads_per_rank": 1},
                       notes=notes, series={"bubbles": bubbles, "analytic": analytic})
