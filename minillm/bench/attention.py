"""Benchmark "attention": peak memory and time of naive vs flash attention as the sequence grows (lesson 03).

SmolLM2-135M's attention shapes at batch 1 (9 query heads, 3 KV heads, head_dim 64), causal prefill of N
tokens. Peak memory is measured, not computed: CUDA's max_memory_allocated on a GPU, on a CPU the RSS
high-water mark one call adds in a fresh worker process (`measure_cpu_peaks`). Naive attention materialises
the N x N scores, O(N^2); the flash loop's tiles are O(N). Time is measured side by side in this process: on a
CPU the torch flash loop is slower than naive, the fused kernels are what is fast (torch's SDPA;
kernels/flash_attn.py on a GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from minillm.measure.harness import BenchResult, time_fn

BATCH, N_HEADS, N_KV_HEADS, HEAD_DIM = 1, 9, 3, 64
METHODS = ("naive", "flash", "sdpa")


def make_inputs(n: int, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, N_HEADS, n, HEAD_DIM, generator=g)
    k = torch.randn(BATCH, N_KV_HEADS, n, HEAD_DIM, generator=g)
    v = torch.randn(BATCH, N_KV_HEADS, n, HEAD_DIM, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]


# ------------------------------------------------------------------------------------------ peak memory, CPU


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def cpu_peak_worker(cases: list[tuple[str, int]]) -> list[dict]:
    """Run in a fresh process: for each (method, n), the RSS high-water mark one call adds, in bytes."""
    import gc

    from minillm.attention import get_attention

    torch.set_num_threads(2)
    results = []
    for method, n in cases:
        fn = get_attention(method)
        q, k, v = make_inputs(n)
        fn(*make_inputs(16))  # lazy initialisation happens outside the measurement
        gc.collect()
        rss_before = _proc_status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        out = fn(q, k, v)
        peak = _proc_status_kib("VmHWM")
        results.append({"method": method, "N": n, "peak_bytes": (peak - rss_before) * 1024})
        del out, q, k, v
    return results


def measure_cpu_peaks(cases: list[tuple[str, int]]) -> list[dict]:
    """cpu_peak_worker in a fresh Python process (so nothing cached by this process pollutes the numbers)."""
    # a fixed mmap threshold: freed tensors go back to the OS between calls instead of being recycled by the next
    # call, which would hide its peak
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    code = ("import json, sys; from minillm.bench.attention import cpu_peak_worker; "
            "print('RESULT' + json.dumps(cpu_peak_worker(json.loads(sys.argv[1]))))")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], env=env, capture_output=True, text=True,
                          check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"peak-memory worker failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT"):])


def measure_cuda_peaks(cases: list[tuple[str, int]]) -> list[dict]:
    from minillm.attention import get_attention

    results = []
    for method, n in cases:
        fn = get_attention(method)
        q, k, v = make_inputs(n, device="cuda")
        fn(*make_inputs(16, device="cuda"))
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn(q, k, v)
        torch.cuda.synchronize()
        results.append({"method": method, "N": n, "peak_bytes": torch.cuda.max_memory_allocated() - before})
        del out
    return results


# ------------------------------------------------------------------------------------------------------- run


def run(quick: bool = False) -> BenchResult:
    from minillm.attention import get_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    lengths = [128, 256, 512] if quick else [256, 512, 1024, 2048, 4096]
    methods = list(METHODS)
    cases = [(m, n) for n in lengths for m in methods]
    peaks = measure_cuda_peaks(cases) if device == "cuda" else measure_cpu_peaks(cases)
    peak = {(r["method"], r["N"]): r["peak_bytes"] for r in peaks}

    rows = []
    for n in lengths:
        q, k, v = make_inputs(n, device=device)
        long = n >= 2048 and device == "cpu"  # the torch flash loop takes seconds there: two timed runs, no warmup
        for m in methods:
            fn = get_attention(m)
            t = time_fn(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v, causal=True), warmup=0 if long else 1,
                        repeat=2 if long else 3)
            rows.append({"N": n, "method": m, "peak_MiB": peak[(m, n)] / 2**20,
                         "scores_MiB": BATCH * N_HEADS * n * n * 4 / 2**20 if m == "naive" else 0.0,
                         "time_ms": t.median * 1e3, "min_ms": t.min * 1e3})

    def row(m, n):
        return next(r for r in rows if r["method"] == m and r["N"] == n)

    n_max = lengths[-1]
    ratios: dict[str, float] = {}
    for n in lengths:
        ratios[f"peak_naive_over_flash_N{n}"] = row("naive", n)["peak_MiB"] / max(row("flash", n)["peak_MiB"], 1e-9)
    # times from the fastest run: on a shared machine the others measure the neighbours
    ratios[f"time_naive_over_flash_N{n_max}"] = row("naive", n_max)["min_ms"] / row("flash", n_max)["min_ms"]
    ratios[f"time_naive_over_sdpa_N{n_max}"] = row("naive", n_max)["min_ms"] / row("sdpa", n_max)["min_ms"]
    targets = {} if quick else {"peak_naive_over_flash_N4096": (">=", 10.0)}
    q_tiles = -(-n_max // 64)
    notes = [
        "peak_MiB: measured " + ("CUDA max_memory_allocated delta" if device == "cuda" else
                                 "RSS high-water delta of one call in a fresh worker process (VmHWM reset)")
        + "; includes the output (B*H*N*D*4 bytes, the same for every method).",
        ("scores_MiB: the (B, H, N, N) float32 score matrix naive attention materialises; its peak is a few of "
         "those (scores, masked scores, probabilities)."),
        (f"time: the torch flash loop runs {q_tiles * (q_tiles + 1) // 2} causal tiles of 64x64 at N={n_max}, "
         "each a Python iteration of ~10 small ops; on a CPU that overhead makes it slower than naive. sdpa is "
         "torch's fused kernel: the speed flash attention promises comes from fusing, which the Triton kernel does "
         "on a GPU."),
    ]
    return BenchResult(
        name="attention", rows=rows, ratios=ratios, targets=targets,
        settings={"device": device, "batch": BATCH, "n_heads": N_HEADS, "n_kv_heads": N_KV_HEADS,
                  "head_dim": HEAD_DIM, "dtype": "float32", "causal": True, "flash_blocks": "64x64",
                  "lengths": lengths},
        notes=notes)
