"""Check and benchmark the Triton flash-attention kernel on a CUDA GPU; write results/attention_gpu.json.

    python scripts/gpu_check_flash.py            # writes $OUT/attention_gpu.json if $OUT is set, else results/

1. Correctness: the CUDA shapes of tests/test_triton_flash.py (GQA, ragged lengths, decode, chunked prefill), causal
   and not, bf16/fp16/fp32, against torch SDPA computed in float32.
2. Speed: forward at B=4, H=16, N=4096, D=64, bf16, causal (and non-causal): Triton vs torch SDPA (whatever
   fused backend torch picks: FlashAttention-2 / cuDNN / efficient) vs naive attention; TFLOP/s counted as
   4*B*H*N^2*D (halved for causal), timed with triton.testing.do_bench (median). Target: Triton >= 0.7x SDPA.
3. Peak memory at that shape (torch.cuda.max_memory_allocated), and a sweep over N for the lesson's plot.

Non-interactive; every section catches its own errors and records them in the JSON, so one failure still leaves
the rest. Exit code: 0 if every correctness case passed, 1 otherwise, 2 without CUDA. Lesson 03 reads the JSON.
"""

import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch

B, H, N, D = 4, 16, 4096, 64
TARGET_RATIO = 0.7
# mirrors CUDA_CASES in tests/test_triton_flash.py: (batch, n_heads, n_kv_heads, q_len, kv_len, head_dim)
CUDA_CASES = [
    (2, 16, 16, 1024, 1024, 64),
    (1, 9, 3, 1000, 1000, 64),
    (2, 8, 2, 1, 4097, 128),
    (1, 8, 4, 300, 2048, 32),
    (4, 4, 1, 513, 513, 16),
]
TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-4}
SWEEP = [512, 1024, 2048, 4096, 8192, 16384]
TIME_BUDGET_S = 420  # skip the optional sweep past this: device time is scarce


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def attention_flops(b, h, q_len, kv_len, d, causal) -> float:
    full = 4.0 * b * h * q_len * kv_len * d  # q k^T and p v, 2 FLOPs per multiply-add
    return full / 2 if causal and q_len == kv_len else full


def check_correctness(triton_attention, sdpa_attention) -> list[dict]:
    rows = []
    for case in CUDA_CASES:
        for causal in (True, False):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                b, h, hkv, tq, tk, d = case
                g = torch.Generator(device="cuda").manual_seed(sum(case))
                q = torch.randn(b, h, tq, d, device="cuda", generator=g).to(dtype)
                k = torch.randn(b, hkv, tk, d, device="cuda", generator=g).to(dtype)
                v = torch.randn(b, hkv, tk, d, device="cuda", generator=g).to(dtype)
                row = {"case": list(case), "causal": causal, "dtype": str(dtype).replace("torch.", "")}
                try:
                    out = triton_attention(q, k, v, causal=causal)
                    ref = sdpa_attention(q.float(), k.float(), v.float(), causal=causal)
                    err = (out.float() - ref).abs().max().item()
                    row.update(max_abs_err=err, passed=bool(err <= TOL[dtype] * (1 + ref.abs().max().item())))
                except Exception as e:  # noqa: BLE001  record and go on: one broken case must not hide the others
                    row.update(passed=False, error=f"{type(e).__name__}: {e}")
                rows.append(row)
                log(f"  {row['case']} causal={causal} {row['dtype']}: "
                    + ("ok" if row["passed"] else "FAIL") + f" {row.get('max_abs_err', row.get('error'))}")
    return rows


def bench_forward(fns: dict, b, h, n, d, causal, dtype=torch.bfloat16) -> dict:
    import triton.testing

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=g).to(dtype) for _ in range(3))
    flops = attention_flops(b, h, n, n, d, causal)
    out = {}
    for name, fn in fns.items():
        try:
            fn(q, k, v, causal=causal)  # compile / autotune outside the timing
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(lambda fn=fn: fn(q, k, v, causal=causal), warmup=25, rep=100,
                                         return_mode="median")
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn(q, k, v, causal=causal)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
            out[name] = {"ms": ms, "tflops": flops / ms / 1e9, "peak_MiB": peak / 2**20}
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        log(f"  {name:>7s} N={n} causal={causal}: {out[name]}")
    return out


def main() -> int:
    out_dir = Path(os.environ.get("OUT") or ROOT / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "attention_gpu.json"
    if not torch.cuda.is_available():
        log("no CUDA device visible to torch: this script needs a GPU (nothing written)")
        return 2
    t_start = time.time()
    import triton
    from minillm_kernels import flash_attn
    from minillm_kernels.flash_attn import triton_attention

    from minillm.attention import naive_attention, sdpa_attention

    result = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": triton.__version__, "python": platform.python_version(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "shape": {"batch": B, "n_heads": H, "seq_len": N, "head_dim": D, "dtype": "bfloat16"},
        "target": {"triton_over_sdpa_tflops": [">=", TARGET_RATIO]},
        "errors": [],
    }

    def save() -> None:
        path.write_text(json.dumps(result, indent=2) + "\n")

    log(f"{result['gpu']}, torch {result['torch']}, triton {result['triton']}")
    log("correctness (first call of each shape also autotunes):")
    try:
        rows = check_correctness(triton_attention, sdpa_attention)
        result["correctness"] = {"cases": rows, "passed": sum(r["passed"] for r in rows), "total": len(rows)}
    except Exception:  # noqa: BLE001  (kept in the JSON)
        result["errors"].append(traceback.format_exc())
        result["correctness"] = {"cases": [], "passed": 0, "total": 0}
    log(f"correctness: {result['correctness']['passed']}/{result['correctness']['total']} passed "
        f"({time.time() - t_start:.0f} s)")
    save()

    fns = {"triton": triton_attention, "sdpa": sdpa_attention, "naive": naive_attention}
    result["bench"] = {}
    for causal in (True, False):
        key = "causal" if causal else "non_causal"
        try:
            result["bench"][key] = bench_forward(fns, B, H, N, D, causal)
        except Exception:  # noqa: BLE001  (kept in the JSON)
            result["errors"].append(traceback.format_exc())
        save()
    result["triton_best_config"] = str(getattr(flash_attn._flash_fwd_tuned, "best_config", None))
    causal = result["bench"].get("causal", {})
    if "tflops" in causal.get("triton", {}) and "tflops" in causal.get("sdpa", {}):
        ratio = causal["triton"]["tflops"] / causal["sdpa"]["tflops"]
        result["triton_over_sdpa_tflops"] = ratio
        result["target_met"] = ratio >= TARGET_RATIO
        log(f"Triton / SDPA throughput, causal bf16 B={B} H={H} N={N} D={D}: {ratio:.2f} "
            f"(target >= {TARGET_RATIO}: {'PASS' if ratio >= TARGET_RATIO else 'MISS'})")
    save()

    # optional: throughput vs sequence length for the lesson's plot (B*N fixed at 16k tokens)
    result["sweep"] = []
    for n in SWEEP:
        if time.time() - t_start > TIME_BUDGET_S:
            log(f"time budget reached: sweep stops before N={n}")
            break
        try:
            b = max(1, 16384 // n)
            res = bench_forward({"triton": triton_attention, "sdpa": sdpa_attention}, b, H, n, D, True)
            result["sweep"].append({"N": n, "batch": b, **{f"{k}_{m}": v for k, r in res.items()
                                                           for m, v in r.items()}})
        except Exception:  # noqa: BLE001  (kept in the JSON)
            result["errors"].append(traceback.format_exc())
        save()
    result["wall_s"] = time.time() - t_start
    save()
    log(f"wrote {path} ({result['wall_s']:.0f} s)")
    return 0 if result["correctness"]["total"] and \
        result["correctness"]["passed"] == result["correctness"]["total"] else 1


if __name__ == "__main__":
    sys.exit(main())
