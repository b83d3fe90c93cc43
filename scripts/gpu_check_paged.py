"""GPU check of the Triton paged decode kernel (kernels/paged_decode.py): correctness and speed vs contiguous decode.

    python scripts/gpu_check_paged.py            # writes $OUT/gpu_check_paged.json (or results/gpu_check_paged.json)

For each config (batch 8..32, context 4096, SmolLM2-like 9/3 heads x 64 and Llama-like 32/8 x 128, bfloat16,
block size 16, shuffled block ids):
  * correctness: the kernel vs SDPA over the same keys held contiguously (fp32 reference), at full context and at
    ragged context lengths (1..4096, not multiples of the block size), for several num_splits;
  * speed: median time of the kernel (default split heuristic, and a sweep) vs contiguous SDPA decode attention
    (q (batch, heads, 1, head_dim) over (batch, kv_heads, 4096, head_dim)), and vs the torch gather. Target: the
    kernel within 1.5x of contiguous. Also the achieved KV read bandwidth.
  * a tiny model on CUDA: PagedKVCache (Triton decode path) vs the contiguous KVCache, logits per step.
Every section records its own error instead of stopping the script. Without CUDA it writes a 'skipped' report.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

CONFIGS = [  # batch, n_heads, n_kv_heads, head_dim
    (8, 9, 3, 64), (32, 9, 3, 64), (8, 32, 8, 128), (32, 32, 8, 128),
]
CONTEXT, BLOCK = 4096, 16


def out_path() -> Path:
    base = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "results"
    base.mkdir(parents=True, exist_ok=True)
    return base / "gpu_check_paged.json"


def cuda_time(fn, repeat: int = 50, warmup: int = 5) -> float:
    """Median seconds per call, measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def make_case(batch, n_heads, n_kv_heads, head_dim, lens, dtype=torch.bfloat16, seed=0):
    """Contiguous K/V (batch, kv_heads, CONTEXT, head_dim) and the same values in a shuffled block pool."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    q = torch.randn(batch, n_heads, head_dim, device=dev, generator=g).to(dtype)
    k = torch.randn(batch, n_kv_heads, CONTEXT, head_dim, device=dev, generator=g).to(dtype)
    v = torch.randn(batch, n_kv_heads, CONTEXT, head_dim, device=dev, generator=g).to(dtype)
    per_seq = CONTEXT // BLOCK
    num_blocks = batch * per_seq + 8
    perm = torch.randperm(num_blocks, device=dev, generator=g)[: batch * per_seq]
    tables = perm.view(batch, per_seq).to(torch.int32)
    k_pool = torch.full((num_blocks, BLOCK, n_kv_heads, head_dim), float("nan"), device=dev, dtype=dtype)
    v_pool = k_pool.clone()
    # (batch, kv_heads, CONTEXT, d) -> (batch * per_seq, BLOCK, kv_heads, d) placed at the table's block ids
    k_pool[tables.flatten().long()] = k.transpose(1, 2).reshape(batch * per_seq, BLOCK, n_kv_heads, head_dim)
    v_pool[tables.flatten().long()] = v.transpose(1, 2).reshape(batch * per_seq, BLOCK, n_kv_heads, head_dim)
    lens_t = torch.tensor(lens, device=dev, dtype=torch.int32)
    return q, k, v, k_pool, v_pool, tables, lens_t


def reference(q, k, v, lens):
    """fp32 SDPA per sequence over its first lens[i] keys."""
    outs = []
    for i, n in enumerate(lens):
        outs.append(F.scaled_dot_product_attention(q[i:i + 1, :, None].float(), k[i:i + 1, :, :n].float(),
                                                   v[i:i + 1, :, :n].float(), enable_gqa=True)[0, :, 0])
    return torch.stack(outs)


def check_config(cfg) -> dict:
    from minillm_kernels.paged_decode import triton_paged_decode

    from minillm.cache.paged_attention import paged_attention

    batch, n_heads, n_kv_heads, head_dim = cfg
    rec: dict = {"batch": batch, "n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim,
                 "context": CONTEXT, "block_size": BLOCK, "dtype": "bfloat16"}
    full = [CONTEXT] * batch
    gen = torch.Generator().manual_seed(1)
    ragged = [1, CONTEXT, 17, BLOCK] + torch.randint(1, CONTEXT + 1, (batch - 4,), generator=gen).tolist()
    q, k, v, k_pool, v_pool, tables, lens_full = make_case(batch, n_heads, n_kv_heads, head_dim, full)
    lens_ragged = torch.tensor(ragged, device="cuda", dtype=torch.int32)
    errors = {}
    for name, lens, lens_t in (("full", full, lens_full), ("ragged", ragged, lens_ragged)):
        ref = reference(q, k, v, lens)
        for splits in (None, 1, 4, 32):
            out = triton_paged_decode(q, k_pool, v_pool, tables, lens_t, num_splits=splits)
            errors[f"{name}_splits{splits or 'auto'}"] = float((out.float() - ref).abs().max())
    rec["max_abs_err"] = errors
    rec["correct"] = all(e < 2e-2 for e in errors.values())  # bf16 output rounding (~4e-3) with margin

    q4 = q[:, :, None]  # (batch, heads, 1, head_dim)
    t_contig = cuda_time(lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True))
    t_kernel = cuda_time(lambda: triton_paged_decode(q, k_pool, v_pool, tables, lens_full))
    sweep = {}
    for splits in (1, 2, 4, 8, 16, 32, 64):
        try:
            sweep[splits] = cuda_time(lambda s=splits: triton_paged_decode(q, k_pool, v_pool, tables, lens_full,
                                                                           num_splits=s), repeat=20) * 1e6
        except Exception as e:  # noqa: BLE001 - record and go on
            sweep[splits] = repr(e)
    k_pool_finite = torch.nan_to_num(k_pool)
    v_pool_finite = torch.nan_to_num(v_pool)
    t_gather = cuda_time(lambda: paged_attention(q, k_pool_finite, v_pool_finite, tables, lens_full), repeat=20)
    kv_bytes = 2 * batch * n_kv_heads * CONTEXT * head_dim * k.element_size()
    rec.update({
        "contiguous_sdpa_us": t_contig * 1e6, "triton_paged_us": t_kernel * 1e6, "torch_gather_us": t_gather * 1e6,
        "triton_vs_contiguous_time": t_kernel / t_contig, "within_1.5x": t_kernel / t_contig <= 1.5,
        "triton_splits_sweep_us": sweep,
        "kv_GBps_triton": kv_bytes / t_kernel / 1e9, "kv_GBps_contiguous": kv_bytes / t_contig / 1e9,
    })
    return rec


@torch.inference_mode()
def check_model() -> dict:
    from minillm.config import ModelConfig
    from minillm.kv_cache import KVCache
    from minillm.model import Transformer
    from minillm.cache.paged import PagedSequenceCache

    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(n_layers=2, dim=128, n_heads=4, n_kv_heads=2)).eval().cuda()
    prompt = torch.randint(0, 512, (2, 37), device="cuda")
    contiguous = KVCache.for_model(model, 2, 64)
    paged = PagedSequenceCache.for_model(model, 2, 64, block_size=16)
    worst = 0.0
    x_c = x_p = prompt
    for _ in range(12):
        a, b = model(x_c, kv_cache=contiguous), model(x_p, kv_cache=paged)
        worst = max(worst, float((a - b).abs().max()))
        x_c = x_p = a[:, -1:].argmax(-1)
    return {"max_abs_logit_diff": worst, "correct": worst < 1e-3}


def main() -> int:
    report: dict = {"script": "gpu_check_paged", "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    path = out_path()
    if not torch.cuda.is_available():
        report["skipped"] = "no CUDA device: run this on a GPU machine"
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(report["skipped"], "->", path)
        return 0
    report["device"] = torch.cuda.get_device_name()
    report["torch"] = torch.__version__
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError as e:
        report["error"] = f"triton missing: {e}"
    report["configs"] = []
    for cfg in CONFIGS:
        try:
            rec = check_config(cfg)
        except Exception:  # noqa: BLE001 - one config failing must not hide the others
            rec = {"config": cfg, "error": traceback.format_exc(limit=6)}
        report["configs"].append(rec)
        print(json.dumps(rec, default=str))
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")  # partial results survive a timeout
    try:
        report["model"] = check_model()
    except Exception:  # noqa: BLE001
        report["model"] = {"error": traceback.format_exc(limit=6)}
    print(json.dumps(report["model"]))
    ok = [c for c in report["configs"] if "error" not in c]
    report["all_correct"] = bool(ok) and all(c["correct"] for c in ok) and report["model"].get("correct", False)
    report["all_within_1.5x"] = bool(ok) and all(c["within_1.5x"] for c in ok)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"all_correct={report['all_correct']} all_within_1.5x={report['all_within_1.5x']} -> {path}")
    return 0 if report["all_correct"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
