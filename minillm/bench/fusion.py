"""`minillm bench fusion` (lesson 06): eager -> fused -> compiled -> native batch-1 decode, and the ops a step issues.

Every variant decodes the same prompt ids greedily in one process, one after another, and the table gives tok/s, the
aten ops one decode step dispatches (eager and fused; a compiled step runs one generated program), and the bytes it
reads per token against three roofs measured in the same run (see `run`). transformers' generate runs beside it in
bf16 (full mode).
"""

from __future__ import annotations

import copy

import torch

from minillm.measure.hardware import bf16_status, probe_bandwidth
from minillm.measure.harness import BenchResult, time_fn
from minillm.measure.metrics import decode_bytes_per_token, decode_tok_s, timer
from minillm.bench.kv_cache import hf_decode, hf_model, matmul_bytes_per_s


def read_bandwidth(device: str = "cpu", n_bytes: int = 256 << 20) -> float:
    """Bytes/s of a large reduction (reads only): the memory roof a decode step's weight reads are held to."""
    x = torch.ones(n_bytes // 4, dtype=torch.float32, device=device)
    return n_bytes / time_fn(lambda: x.sum(), warmup=1, repeat=5).min


_COMPILE_CHILD = """
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
from minillm import generate, load_model
from minillm.measure.metrics import timer
from minillm.compile.fusion import fuse
model, _ = load_model("smollm2-135m", dtype="float32")
fuse(model)
with timer() as t:
    generate(model, None, list(range(100, 116)), max_new_tokens=4, ignore_eos=True, compile=True)
print(t.seconds)
"""


def compile_seconds_in_fresh_process(cache_dir: str) -> float:
    """Seconds a new process spends on its first compiled generate, with inductor's on-disk cache in cache_dir."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", _COMPILE_CHILD, str(torch.get_num_threads())], env=env, check=True,
                         capture_output=True, text=True, timeout=900)
    return float(out.stdout.strip().splitlines()[-1])


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def ladder(base, ids: list[int], n_new: int, repeat: int, dtypes=(torch.float32, torch.bfloat16),
           compiled_dtypes=None) -> tuple[list[dict], dict, dict]:
    """Eager, fused and compiled decode of `base` (a float32 model) in each dtype, and the native step (every layer
    in one C++ call, minillm.compile.native) where it runs, measured round-robin: every round times every variant
    once, and the roofs (read probe, matvec ceiling per dtype) once, so a noisy moment of a shared machine lands on
    all of them; each keeps its best round. Returns table rows, greedy ids per variant, and the compile seconds
    (first compiled call, outside the timings). `compiled_dtypes` limits which dtypes compile."""
    from minillm.compile.fusion import count_ops, fuse
    from minillm.compile.native import enable_native, why_not_native
    from minillm.kv_cache import KVCache

    compiled_dtypes = dtypes if compiled_dtypes is None else compiled_dtypes
    variants, per_token, compile_s = {}, {}, {}
    torch._dynamo.reset()  # once: a reset between compiles would drop the first one and recompile it in the timings
    for dtype in dtypes:
        eager = base if dtype == base.dtype else copy.deepcopy(base).to(dtype)
        fused = fuse(copy.deepcopy(eager))
        d = str(dtype).replace("torch.", "")
        per_token[d] = (decode_bytes_per_token(eager, len(ids) + n_new // 2), eager)
        variants[f"eager {d}"], variants[f"fused {d}"] = (eager, False, d), (fused, False, d)
        if dtype in compiled_dtypes:
            variants[f"compiled {d}"] = (fused, True, d)
            with timer() as t:
                decode_tok_s(fused, ids, 4, 1, compile=True)
            compile_s[f"compiled {d}"] = t.seconds
        if why_not_native(fused) is None:
            variants[f"native {d}"] = (enable_native(fuse(copy.deepcopy(eager))), False, d)
    best = {k: 0.0 for k in variants}
    tokens, read_bw, copy_bw, ceiling = {}, 0.0, 0.0, {d: 0.0 for d in per_token}
    for _ in range(repeat):
        read_bw = max(read_bw, read_bandwidth())
        copy_bw = max(copy_bw, probe_bandwidth())
        for d, (_, eager) in per_token.items():
            ceiling[d] = max(ceiling[d], matmul_bytes_per_s(eager, repeat=3))
        for key, (model, compiled, _) in variants.items():
            tps, tokens[key] = decode_tok_s(model, ids, n_new, 1, compile=compiled)
            best[key] = max(best[key], tps)
    rows = []
    for key, (model, compiled, d) in variants.items():
        ops = None
        if not compiled:
            cache = KVCache.for_model(model, 1, len(ids) + 1)
            with torch.inference_mode():
                model(torch.tensor([ids]), kv_cache=cache)
            ops = count_ops(model, torch.tensor([ids[:1]]), kv_cache=cache)
        moved = per_token[d][0]
        rows.append({"variant": key, "decode_tok_s": best[key], "ops_per_step": ops, "bytes_per_token": moved,
                     "mbu": moved * best[key] / copy_bw, "of_read_probe": moved * best[key] / read_bw,
                     "of_matmul_ceiling": moved * best[key] / ceiling[d],
                     "roof_tok_s": copy_bw / moved, "ceiling_tok_s": ceiling[d] / moved,
                     "compile_s": compile_s.get(key)})
    return rows, tokens, {"compile_s": compile_s, "read_GBps": read_bw / 1e9, "copy_GBps": copy_bw / 1e9}


def run(quick: bool = False) -> BenchResult:
    """The table of `ladder`, with bytes read per token against three roofs measured in the same run.

    MBU, over the copy probe (hardware.probe_bandwidth, the peak bytes/s every lesson and bench divides by); the share
    of a read-only probe (a large reduction: a decode step only *reads* weights); and the share of the ceiling of
    torch's own batch-1 matrix-vector products over the model's weights, with nothing else in the step (what torch
    can reach on this machine at all).
    """
    from minillm.api import load_model

    prompt_len, n_new, repeat = (16, 12, 1) if quick else (32, 128, 3)
    base, tok = load_model("smollm2-135m", dtype="float32", device="cpu")
    ids = tok.encode("The history of the printing press begins with " * 8)[:prompt_len]
    rows, tokens, extra = ladder(base, ids, n_new, repeat)
    by = {r["variant"]: r for r in rows}
    tok_s, compile_s = {k: r["decode_tok_s"] for k, r in by.items()}, extra["compile_s"]
    ratios = {
        "fused_vs_eager_ops_float32": by["fused float32"]["ops_per_step"] / by["eager float32"]["ops_per_step"],
        "fused_vs_eager_float32": tok_s["fused float32"] / tok_s["eager float32"],
        "compiled_vs_eager_float32": tok_s["compiled float32"] / tok_s["eager float32"],
        "compiled_vs_eager_bfloat16": tok_s["compiled bfloat16"] / tok_s["eager bfloat16"],
        "eager_float32_of_matmul_ceiling": by["eager float32"]["of_matmul_ceiling"],
        "compiled_bfloat16_of_matmul_ceiling": by["compiled bfloat16"]["of_matmul_ceiling"],
        "compiled_tokens_identical_float32": float(tokens["compiled float32"] == tokens["eager float32"]),
    }
    if "native float32" in by:  # lesson 06's last rung: the float32 weights read by f32_matmul.cpp, not torch
        ratios["native_vs_eager_float32"] = tok_s["native float32"] / tok_s["eager float32"]
        ratios["native_float32_of_matmul_ceiling"] = by["native float32"]["of_matmul_ceiling"]
        ratios["native_tokens_identical_float32"] = float(tokens["native float32"] == tokens["eager float32"])
    targets = {"compiled_vs_eager_bfloat16": (">=", 1.5), "compiled_bfloat16_of_matmul_ceiling": (">=", 0.85),
               "compiled_tokens_identical_float32": (">=", 1)}
    div = first_divergence(tokens["compiled bfloat16"], tokens["eager bfloat16"])
    notes = [f"bf16 on this CPU: {bf16_status('cpu')}",
             (f"compiled bf16 greedy tokens equal eager bf16's for all {n_new}" if div is None else
              f"compiled bf16 greedy tokens first differ from eager bf16's at new token {div} of {n_new} (fused "
              f"matmuls and generated kernels sum bf16 products in another order)"),
             "variants, roofs and the matvec ceiling are timed round-robin, best round each (a shared machine)",
             ("mbu divides the bytes read per token (weights + KV) x tok/s by the copy probe (reads + writes "
              "counted), the peak bytes/s every bench uses; of_read_probe by a read-only probe (a large reduction)")]
    if not quick:  # transformers in the same run, bf16; and a second process compiling from inductor's disk cache
        hf = hf_model(torch.bfloat16)
        hf_decode(hf, ids, 4)
        hf_s = min(hf_decode(hf, ids, n_new)[1] for _ in range(repeat))  # best round, as for minillm
        tok_s["transformers bfloat16"] = n_new / hf_s
        rows.append({"variant": "transformers bfloat16 (generate, incl. prefill)", "decode_tok_s": n_new / hf_s})
        ratios["compiled_bf16_vs_transformers_bf16"] = tok_s["compiled bfloat16"] / tok_s["transformers bfloat16"]
        targets["compiled_bf16_vs_transformers_bf16"] = (">=", 1.3)
        del hf
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            cold, warm = compile_seconds_in_fresh_process(d), compile_seconds_in_fresh_process(d)
        compile_s["new process, empty inductor cache"], compile_s["new process, warm inductor cache"] = cold, warm
        ratios["compile_cold_over_warm_disk_cache"] = cold / warm
    return BenchResult(
        name="fusion", rows=rows, ratios=ratios, targets=targets,
        settings={"prompt_tokens": prompt_len, "new_tokens": n_new, "batch": 1, "repeat": repeat,
                  "threads": torch.get_num_threads(), "read_GBps": extra["read_GBps"],
                  "copy_GBps": extra["copy_GBps"], "compile_s": compile_s},
        notes=notes)
