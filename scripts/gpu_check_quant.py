"""GPU check of lesson 07: bf16 matmul vs the Triton int8 / int4 weight-only matmuls (kernels/quant_matmul.py).

    python scripts/gpu_check_quant.py          # writes $OUT/quant.json (default results/gpu/quant.json)

For SmolLM2-135M's weight shapes (N, K) and M = 1 (decode), 16 (a decode batch), 256 (prefill): the median time of
one call with a cold L2 (triton.testing.do_bench flushes it between calls, as a real forward pass, whose weights do
not fit in L2, would see), the weight bytes read per microsecond (GB/s, scale tables included), the speedup over
torch's bf16 matmul, and the largest error against dequantize-then-matmul in fp32 (relative to the largest output).
Random weights: speed does not depend on the values. Without CUDA it prints a message and writes a 'skipped' report.
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

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]  # (N, K): qkv, o, gate+up, down, head
BATCHES = [1, 16, 256]
GROUPS = [32, 64]  # 128 does not divide K = 576


def measure(m: int, n: int, k: int) -> dict:
    from minillm_kernels.quant_matmul import int4_group_matmul, int8_weight_matmul
    from triton.testing import do_bench

    gen = torch.Generator(device="cuda").manual_seed(n * k + m)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
    q = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8, generator=gen)
    scale = (torch.rand(n, device="cuda", generator=gen) * 0.01).bfloat16()
    variants = {"bf16": (lambda: x @ w.T, n * k * 2, x.float() @ w.float().T),
                "int8": (lambda: int8_weight_matmul(x, q, scale), n * k + n * 2,
                         x.float() @ (q.float() * scale.float()[:, None]).T)}
    for g in GROUPS:
        codes = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.uint8, generator=gen)
        packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
        s4 = (torch.rand(n, k // g, device="cuda", generator=gen) * 0.005).half()
        m4 = (-torch.rand(n, k // g, device="cuda", generator=gen) * 0.04).half()
        groups = torch.arange(k, device="cuda") // g
        ref = x.float() @ (codes.float() * s4.float()[:, groups] + m4.float()[:, groups]).T
        variants[f"int4_g{g}"] = (lambda p=packed, s=s4, mn=m4, g=g: int4_group_matmul(x, p, s, mn, g),
                                  n * k // 2 + 2 * 2 * n * (k // g), ref)
    row: dict = {"M": m, "N": n, "K": k}
    for name, (fn, nbytes, ref) in variants.items():
        err = ((fn().float() - ref).abs().max() / ref.abs().max()).item()  # also compiles the kernel
        us = do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
        row[name] = {"us": round(us, 2), "weight_GB_s": round(nbytes / us / 1e3, 1), "rel_err": float(f"{err:.2e}")}
    for name in variants:
        row[name]["speedup_vs_bf16"] = round(row["bf16"]["us"] / row[name]["us"], 2)
    return row


def main() -> int:
    base = Path(os.environ.get("OUT") or ROOT / "results" / "gpu")
    base.mkdir(parents=True, exist_ok=True)
    path = base / "quant.json"
    report: dict = {"script": "gpu_check_quant", "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    if not torch.cuda.is_available():
        report["skipped"] = "no CUDA device: run this on a GPU machine"
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(report["skipped"])
        return 0
    try:
        report["gpu"] = torch.cuda.get_device_name()
        report["rows"] = []
        names = ["bf16", "int8", *(f"int4_g{g}" for g in GROUPS)]
        print(f"{'M':>4} {'N':>6} {'K':>5} | " + " | ".join(f"{n:>22}" for n in names))
        print(f"{'':>18}| " + " | ".join(f"{'us  GB/s  x-bf16':>22}" for _ in names))
        for n, k in SHAPES:
            for m in BATCHES:
                row = measure(m, n, k)
                report["rows"].append(row)
                cells = [f"{row[v]['us']:7.1f} {row[v]['weight_GB_s']:6.0f} {row[v]['speedup_vs_bf16']:6.2f}x"
                         for v in names]
                print(f"{m:>4} {n:>6} {k:>5} | " + " | ".join(f"{c:>22}" for c in cells))
        report["max_rel_err"] = {v: max(r[v]["rel_err"] for r in report["rows"]) for v in names}
        report["errors_ok"] = all(e < 2e-2 for e in report["max_rel_err"].values())
        decode = [r for r in report["rows"] if r["M"] == 1]
        report["decode_speedup_geomean"] = {
            v: round(float(torch.tensor([r[v]["speedup_vs_bf16"] for r in decode]).log().mean().exp()), 2)
            for v in names}
    except Exception:  # noqa: BLE001 - the report records it; the other GPU checks still run
        report["error"] = traceback.format_exc()
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
