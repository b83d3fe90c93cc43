"""Benchmark "decode": the anatomy of plain inference on this hardware (lesson 00).

Prefill (many tokens through every weight at once) is compute-bound, judged by MFU; decode (one token per
step, each weight byte read for 2 FLOPs) is memory-bound, judged by MBU; both against the roofs
minillm.measure.hardware measures. Rows: prefill and cached decode in float32 and bfloat16, and the no-cache
decode lesson 01 removes. Where the CPU emulates bf16, the bf16 rows measure the emulation (prefill at one
size, no MFU; the notes say so).
"""

from __future__ import annotations

import copy

import torch

from minillm.measure.hardware import bandwidth, bf16_status, native_bf16, peak_flops
from minillm.measure.harness import BenchResult, time_fn
from minillm.measure.metrics import (
    decode_bytes_per_token,
    decode_tok_s,
    mbu,
    mfu,
    peak_memory,
    prefill_flops,
    timed_decode,
)


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    """A reproducible prompt of `n` ordinary token ids (specials 0..16 avoided)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(17, vocab, (n,), generator=g).tolist()


@torch.inference_mode()
def measure_prefill(model, n_tokens: int, repeat: int = 3) -> dict:
    """One forward over `n_tokens` (logits for the last position only, as generate does): time, tokens/s, MFU."""
    ids = torch.tensor([prompt_ids(n_tokens, model.config.vocab_size)], device=model.device)
    t = time_fn(lambda: model(ids, last_only=True), warmup=1, repeat=repeat)
    flops = prefill_flops(model.config, n_tokens, logits_for=1)  # last_only: one row through the LM head
    emulated = model.dtype != torch.float32 and not native_bf16(model.device)  # no roof: emulation has no peak
    return {"phase": "prefill", "tokens": n_tokens, "context": n_tokens, "ms": t.median * 1e3,
            "tokens_per_s": n_tokens / t.median,
            "MFU": None if emulated else mfu(flops, t.median, peak_flops(model.dtype, model.device)), "MBU": None}


def measure_decode(model, prompt_len: int, new_tokens: int, cache: str = "contiguous",
                   repeat: int = 2) -> dict:
    """Greedy batch-1 decode of exactly `new_tokens` after a `prompt_len` prompt: median decode tokens/s and MBU."""
    ids = prompt_ids(prompt_len, model.config.vocab_size)
    timed_decode(model, ids, min(4, new_tokens), cache)  # warmup
    tps = decode_tok_s(model, ids, new_tokens, repeat, cache)[0]
    mean_context = prompt_len + new_tokens // 2
    moved = decode_bytes_per_token(model, mean_context)
    return {"phase": "decode" if cache != "none" else "decode, no cache", "tokens": new_tokens,
            "context": mean_context, "ms": 1e3 / tps, "tokens_per_s": tps, "MFU": None,
            # without a cache a step re-reads the weights once but recomputes every token: MBU is not its bound
            "MBU": mbu(moved, 1 / tps, bandwidth(model.device)) if cache != "none" else None}


def cast_model(model, dtype: torch.dtype):
    """A copy of `model` with weights in `dtype` (what load_model(dtype=...) gives, without re-reading the GGUF);
    the RoPE tables stay float32 (Transformer._apply keeps them so)."""
    return copy.deepcopy(model).to(dtype)


def run(quick: bool = False) -> BenchResult:
    from minillm.api import load_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    prefill_sizes = (16, 32) if quick else (128, 512)
    prompt_len, new_tokens, nocache_tokens = (16, 8, 4) if quick else (128, 64, 16)
    repeat = 1 if quick else 3
    rows, by = [], {}
    bf16_gemm = native_bf16(device)
    fp32_model, _ = load_model("smollm2-135m", dtype="float32", device=device)
    rows.append({"dtype": "float32", "phase": "load", "tokens": 0, "context": 0,
                 "ms": fp32_model.load_seconds * 1e3})
    for dtype in ("float32", "bfloat16"):
        model = fp32_model if dtype == "float32" else cast_model(fp32_model, torch.bfloat16)
        # emulated bf16 GEMMs are tens of times slower than fp32: one prefill size, no MFU
        for n in prefill_sizes if dtype == "float32" or bf16_gemm else prefill_sizes[:1]:
            rows.append({"dtype": dtype, **measure_prefill(model, n, repeat)})
            by[dtype, "prefill", n] = rows[-1]
        rows.append({"dtype": dtype, **measure_decode(model, prompt_len, new_tokens, "contiguous", repeat)})
        by[dtype, "decode"] = rows[-1]
        if dtype == "float32":
            rows.append({"dtype": dtype, **measure_decode(model, prompt_len, nocache_tokens, "none", 1)})
            by[dtype, "nocache"] = rows[-1]
        del model

    del fp32_model
    fp32_decode = by["float32", "decode"]["tokens_per_s"]
    ratios = {
        "prefill_vs_decode_tokens_per_s": by["float32", "prefill", prefill_sizes[-1]]["tokens_per_s"] / fp32_decode,
        "bf16_vs_fp32_decode_speedup": by["bfloat16", "decode"]["tokens_per_s"] / fp32_decode,
        "cached_vs_nocache_decode_speedup": fp32_decode / by["float32", "nocache"]["tokens_per_s"],
        "decode_mbu_float32": by["float32", "decode"]["MBU"],
        "prefill_mfu_float32": by["float32", "prefill", prefill_sizes[-1]]["MFU"],
    }
    targets = {
        "prefill_vs_decode_tokens_per_s": (">=", 5.0),
        "bf16_vs_fp32_decode_speedup": (">=", 1.2),
        "cached_vs_nocache_decode_speedup": (">=", 1.5 if quick else 2.0),
    }
    notes = [
        "prefill MFU divides by the measured peak of a large square matmul; the model's 576-wide matmuls reach less",
        "decode MBU = (weights + KV bytes read per step) x tokens/s / measured copy bandwidth (read + write bytes)",
        ("bf16 halves the bytes per decode step; on a GPU at batch 1 this small model is launch-bound instead, "
         "so bf16 and MBU gain little there"),
        "no-cache decode re-runs the whole sequence per token; its cost grows with length (lesson 01 removes it)",
    ]
    if device == "cpu":
        notes.append("CPU timings on a shared machine are noisy: ratios are measured in one run, medians reported")
    if not bf16_gemm:
        notes.append(bf16_status(device) + ". The bf16 rows measure torch's emulation: bf16 prefill is timed at "
                     "one size, without MFU; bf16_vs_fp32_decode_speedup says what bf16 buys on this CPU, not on "
                     "one with bf16 instructions")
    settings = {"device": device, "model": "smollm2-135m", "prefill_tokens": list(prefill_sizes),
                "prompt_len": prompt_len, "new_tokens": new_tokens, "nocache_new_tokens": nocache_tokens,
                "batch": 1, "sampling": "greedy, ignore_eos", "repeat": repeat,
                "threads": torch.get_num_threads(), "peak_memory_MiB": round(peak_memory(device) / 2**20)}
    return BenchResult(name="decode", rows=rows, ratios=ratios, targets=targets, settings=settings, notes=notes)
