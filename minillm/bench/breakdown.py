"""`minillm bench breakdown`: where one step of SmolLM2-135M spends its time, against its byte and compute floors.

Rows: a batch-1 decode step, a speculative verify step (k=4 drafts), batched decode steps of 8 and 16 sequences,
and on a CPU the native step's decode and verify (float32 weights; 4-bit ones over a float32 and an int8 KV cache:
issue 39's terms); each split by minillm.measure.breakdown into weight matmuls, attention, elementwise ops,
sampling and Python/dispatch, in float32 (and bfloat16 where the CPU computes it natively). The lessons that build
the native CPU step read it to see which term they are removing.
"""

from __future__ import annotations

import torch

from minillm.measure.breakdown import TERMS, Breakdown, step_breakdown
from minillm.measure.hardware import bandwidth, hardware_info, native_bf16, peak_flops
from minillm.measure.harness import BenchResult

K = 4


def steps(quick: bool) -> list[tuple[str, int]]:
    """(kind, batch) of each row; quick leaves batch 16 out."""
    return [("decode", 1), ("verify", 1), ("batch", 8)] + ([] if quick else [("batch", 16)])


def run(quick: bool = False) -> BenchResult:
    from minillm.api import load_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    context, repeat = (64, 3) if quick else (512, 7)
    info = hardware_info(device)  # measured once, here: the floors divide by the same roofs the header prints
    bw = bandwidth(device)
    fp32, _ = load_model("smollm2-135m", dtype="float32", device=device)
    dtypes = ["float32"] + (["bfloat16"] if native_bf16(device) else [])
    rows, by = [], {}
    for dtype in dtypes:
        model = fp32 if dtype == "float32" else _cast(fp32, dtype)
        for kind, batch in steps(quick) if dtype == "float32" or not quick else steps(quick)[:1]:
            bd = step_breakdown(model, kind, batch=batch, k=K, context=context, repeat=repeat, bandwidth=bw,
                                flops_per_s=peak_flops(model.dtype, device))
            by[dtype, kind, batch] = bd
            rows.append({"dtype": dtype, **bd.as_row(), "largest": bd.largest()})
            print("  " + bd.line(), flush=True)
        del model
    # lesson 06's last rung, issue 39's terms: the float32 weights and the file's 4-bit ones in the native step
    for label, caches in (("float32 native", ("",)), ("q4 native", ("", " int8 KV"))) if device == "cpu" else ():
        native = _native("dequantized" if label == "float32 native" else "q4")
        for cache in caches if native is not None else ():
            for kind in ("decode", "verify"):
                bd = step_breakdown(native, kind, k=K, context=context, repeat=repeat, bandwidth=bw,
                                    kv_dtype=torch.int8 if cache else None)
                by[label + cache, kind, 1] = bd
                rows.append({"dtype": label + cache, **bd.as_row(), "largest": bd.largest()})
                print(f"  {label}{cache} " + bd.line(), flush=True)
        del native
    decode, verify, b8 = by["float32", "decode", 1], by["float32", "verify", 1], by["float32", "batch", 8]
    ratios = {f"decode_{t}_share": decode.shares[t] for t in TERMS}
    ratios |= {
        "decode_wall_over_floor": decode.wall_ms / decode.floor_ms,
        "verify_vs_decode_wall": verify.wall_ms / decode.wall_ms,
        "batch8_vs_decode_wall": b8.wall_ms / decode.wall_ms,
        "batch8_matmul_share": b8.shares["matmul"],
    }
    targets = {}
    if ("float32 native", "decode", 1) in by:
        f32d = by["float32 native", "decode", 1]
        ratios["float32_native_vs_eager_decode_speed"] = decode.wall_ms / f32d.wall_ms
        ratios["float32_native_decode_wall_over_floor"] = f32d.wall_ms / f32d.floor_ms
    for label, key in (("float32 native", "float32_native"), ("q4 native", "q4_native"),
                       ("q4 native int8 KV", "q4_native_int8kv")):
        if (label, "decode", 1) in by:
            nd, nv = by[label, "decode", 1], by[label, "verify", 1]
            ratios[f"{key}_decode_non_matmul_share"] = 1 - nd.shares["matmul"]
            ratios[f"{key}_verify_vs_decode_wall"] = nv.wall_ms / nd.wall_ms
            # where the verify step's excess over a decode step goes, in decode steps: 1 + these = the ratio above
            for term in ("matmul", "attention"):
                ratios[f"{key}_verify_{term}_excess"] = (nv.terms[term] - nd.terms[term]) / nd.wall_ms
            # a step at its byte floor spends at least this share reading the KV cache: attention's own floor
            ratios[f"{key}_decode_kv_byte_share"] = nd.settings["kv_bytes"] / nd.settings["bytes_read"]
            if key != "float32_native":  # issue 39's targets are the 4-bit step's
                targets |= {f"{key}_decode_non_matmul_share": ("<=", 0.15),
                            f"{key}_verify_vs_decode_wall": ("<=", 1.1)}
    return BenchResult(name="breakdown", rows=rows, ratios=ratios, targets=targets, notes=_notes(by, dtypes, context),
                       settings={"device": device, "model": "smollm2-135m", "context": context, "k": K,
                                 "repeat": repeat, "dtypes": dtypes, "threads": torch.get_num_threads(),
                                 "copy_GBps": round(bw / 1e9, 2)},
                       hardware=info)


def _native(weights: str):
    """SmolLM2 on `weights` (its float32 ones, "dequantized", or the file's 4-bit ones, "q4") with every layer of a
    step in one C++ call, or None where the kernels cannot run it (said on stderr)."""
    from minillm.api import load_model
    from minillm.compile.native import why_not_native

    model, _ = load_model("smollm2-135m", weights=weights, native="auto")
    return model if why_not_native(model) is None else None


def _cast(model, dtype: str):
    import copy

    # a copy: the float32 rows keep their model (load_model's dtype= would re-read the GGUF)
    return copy.deepcopy(model).to(getattr(torch, dtype))


def _notes(by: dict[tuple, Breakdown], dtypes: list[str], context: int) -> list[str]:
    """Sentences computed from the measured breakdowns."""
    decode, verify = by["float32", "decode", 1], by["float32", "verify", 1]
    per_op_us = decode.terms["else"] / max(decode.n_ops, 1) * 1e3
    notes = [(f"float32 decode b=1 after {context} tokens: {decode.wall_ms:.1f} ms, largest term {decode.largest()} "
              f"({decode.shares[decode.largest()]:.0%}); the byte floor is {decode.byte_floor_ms:.1f} ms, so the step "
              f"runs at {decode.wall_ms / decode.byte_floor_ms:.1f}x it; Python/dispatch ('else') is "
              f"{decode.terms['else']:.1f} ms over {decode.n_ops} ops ({per_op_us:.1f} us per op)"),
             (f"verify k={K} scores {K + 1} tokens for {verify.wall_ms / decode.wall_ms:.2f}x a decode step's time "
              f"(matmul {verify.terms['matmul']:.1f} vs {decode.terms['matmul']:.1f} ms)")]
    for (dtype, kind, batch), bd in by.items():
        if dtype == "float32" and kind == "batch":
            speedup = batch * decode.wall_ms / bd.wall_ms
            notes.append(f"batch {batch}: {batch} tokens for {bd.wall_ms / decode.wall_ms:.2f}x a decode step "
                         f"({speedup:.1f}x the tokens/s); attention {bd.shares['attention']:.0%} "
                         f"({bd.terms['attention']:.1f} ms; {decode.shares['attention']:.0%} at b=1); compute floor "
                         f"{bd.compute_floor_ms:.1f} ms vs byte floor {bd.byte_floor_ms:.1f} ms")
    if "bfloat16" in dtypes:
        bf = by["bfloat16", "decode", 1]
        notes.append(f"bfloat16 decode b=1: {bf.wall_ms:.1f} ms ({decode.wall_ms / bf.wall_ms:.2f}x float32's speed), "
                     f"matmul {bf.terms['matmul']:.1f} ms vs {decode.terms['matmul']:.1f} ms")
    if ("float32 native", "decode", 1) in by:
        f32d = by["float32 native", "decode", 1]
        notes.append(f"float32 native decode b=1: {f32d.wall_ms:.1f} ms against eager float32's {decode.wall_ms:.1f} "
                     f"({decode.wall_ms / f32d.wall_ms:.2f}x the speed; the same weights, read where they lie by "
                     f"f32_matmul.cpp): matmul {f32d.terms['matmul']:.1f} ms (eager {decode.terms['matmul']:.1f}) "
                     f"over a byte floor of {f32d.byte_floor_ms:.1f}, the rest "
                     f"{f32d.wall_ms - f32d.terms['matmul']:.1f} ms over {f32d.n_ops} ops (eager "
                     f"{decode.wall_ms - decode.terms['matmul']:.1f} ms over "
                     f"{decode.n_ops})")
    for label in ("float32 native", "q4 native", "q4 native int8 KV"):
        if (label, "decode", 1) not in by:
            continue
        nd, nv = by[label, "decode", 1], by[label, "verify", 1]
        t, kv, read = nd.terms, nd.settings["kv_bytes"], nd.settings["bytes_read"]
        weights = "float32 layers and LM head" if label.startswith("float32") else "4-bit layers and 8-bit LM head"
        notes.append(f"{label.split()[0]} native decode b=1 ({nd.settings['kv_dtype']} KV cache): {nd.wall_ms:.2f} "
                     f"ms, matmul {t['matmul']:.2f} ms "
                     f"({nd.shares['matmul']:.0%}: the {weights}), attention "
                     f"{t['attention']:.2f}, elementwise {t['elementwise']:.2f}, sampling {t['sampling']:.2f}, Python "
                     f"around the call {t['else']:.2f} over {nd.n_ops} ops (float32 eager: {decode.n_ops}); verify "
                     f"k={K}: {nv.wall_ms / nd.wall_ms:.2f}x the decode step, of which its matmuls add "
                     f"{(nv.terms['matmul'] - t['matmul']) / nd.wall_ms:.2f}x ({nv.terms['matmul']:.2f} vs "
                     f"{t['matmul']:.2f} ms: {K + 1} rows through kernels that one row leaves memory-bound), its "
                     f"attention {(nv.terms['attention'] - t['attention']) / nd.wall_ms:.2f}x "
                     f"({nv.terms['attention']:.2f} vs {t['attention']:.2f} ms): were its other terms a decode "
                     f"step's, its matmuls alone would put it at "
                     f"{1 + (nv.terms['matmul'] - t['matmul']) / nd.wall_ms:.2f}x. "
                     f"The cache is {kv / 1e6:.1f} MB of the {read / 1e6:.1f} MB the step "
                     f"reads ({kv / read:.0%}): a step at its byte floor spends at least that share in attention "
                     f"(measured: {nd.shares['attention']:.0%})")
    overhead = [bd.profiled_wall_ms / bd.wall_ms - 1 for bd in by.values()]
    notes.append(f"under the profiler steps took {min(overhead):+.0%} to {max(overhead):+.0%} of their un-profiled "
                 "wall; each row keeps the profiled step's proportions, scaled to the un-profiled median wall, and "
                 "'else' is the profiled step's time outside any op")
    noisy = [bd.label for bd in by.values() if not 0.5 < bd.profiled_wall_ms / bd.wall_ms < 2]
    if noisy:
        notes.append(f"{', '.join(noisy)}: profiled and un-profiled steps differ by 2x or more, more than the "
                     "profiler adds: the machine was busy, so those splits are unreliable (rerun with fewer --threads)")
    return notes
