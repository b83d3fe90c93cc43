"""The ladder's arithmetic (lesson 14): what each rung gains, what two techniques do together, how often tokens agree.

Pure functions of measured throughputs and engine logs, tested without serving anything: `waterfall` chains each
rung's gain, `interference` sets gain(A+B) against gain(A) x gain(B), `interference_pairs` explains three pairs from
what their runs logged, `agreement` is the quality column.
"""

from __future__ import annotations

import math

MiB = 2**20


def agreement(outputs: list, reference: list) -> float:
    """Fraction of output tokens equal, position by position, to the reference's (same requests, same lengths)."""
    same = sum(a == b for o, r in zip(outputs, reference) for a, b in zip(o.token_ids, r.token_ids))
    total = sum(len(r.token_ids) for r in reference)
    return same / total if total else float("nan")


def waterfall(tok_per_s: list[float], rung0: float, rung1_subset: float | None = None) -> list[tuple[float, float]]:
    """(gain vs rung 0, gain vs the previous rung) for rungs 1..n, given throughputs of rungs 1..n (index 0 is rung
    1) and of rung 0. Rung 0 ran only on a subset, where rung 1 ran too (rung1_subset): gain vs rung 0 = rung k /
    rung 1 x rung 1 / rung 0 on the subset. rung1_subset None: rung 0 ran the whole workload."""
    base = (rung1_subset if rung1_subset is not None else tok_per_s[0]) / rung0
    out, prev = [], None
    for i, t in enumerate(tok_per_s):
        vs0 = t / tok_per_s[0] * base
        out.append((vs0, base if i == 0 else t / prev))
        prev = t
    return out


def interference(base: float, a: float, b: float, ab: float) -> dict[str, float]:
    """Throughputs of a base, base+A, base+B, base+A+B -> gains vs base and gain(A+B) / (gain(A) x gain(B)):
    1 = independent, < 1 = they compete for the same saving (or one removes what the other needs), > 1 = they help
    each other."""
    ga, gb, gab = a / base, b / base, ab / base
    return {"gain_a": ga, "gain_b": gb, "gain_ab": gab, "product": ga * gb, "interference": gab / (ga * gb)}


def _decode_steps(step_log: list[dict]) -> list[dict]:
    return [s for s in step_log if s["num_prefill_tokens"] == 0 and s["num_decodes"]]


def _direction(ratio: float, tolerance: float = 0.05) -> str:
    """How gain(A+B) compares with gain(A) x gain(B), in words (within `tolerance`: independent)."""
    if abs(ratio - 1) <= tolerance:
        return "about the product (independent)"
    return "less than the product" if ratio < 1 else "more than the product"


def interference_pairs(runs: dict, mean_ctx: float, kv_per_token_fp32: int, by: dict, budget: int
                       ) -> dict[str, dict]:
    """The three pairs over rung 2 (the third over rung 2 at max_num_seqs 1), each with a 'why' computed from what
    the runs logged: bytes per step, prompt tokens computed and steps taken, acceptance and tokens per step."""
    tps = {k: v["tok_per_s"] for k, v in runs.items()}
    base, out = tps["2"], {}

    p = interference(base, tps["2 + q4 weights"], tps["2 + int8 KV"], tps["2 + q4 weights + int8 KV"])
    seqs = _mean([s["num_seqs"] for s in _decode_steps(runs["2"]["steps"])])
    kv = seqs * mean_ctx * kv_per_token_fp32  # bytes of fp32 KV a decode step reads, on average
    w32, w4 = by["2"]["weights_MiB"] * MiB, by["4"]["weights_MiB"] * MiB
    p["why"] = (f"{_direction(p['interference'])}: int8 KV gained x{p['gain_b']:.2f} over fp32 weights and "
                f"x{p['gain_ab'] / p['gain_a']:.2f} over q4 weights. A decode step reads ~{kv / MiB:.0f} MiB of fp32 "
                f"KV ({seqs:.1f} sequences x ~{mean_ctx:.0f} tokens): {kv / (kv + w32):.0%} of its bytes beside "
                f"{w32 / MiB:.0f} MiB of fp32 weights, {kv / (kv + w4):.0%} beside {w4 / MiB:.0f} MiB of q4 weights")
    out["q4_weights_x_int8_kv"] = p

    names = ("2 + prefix caching", "2 + chunked prefill", "2 + prefix caching + chunked prefill")
    p = interference(base, *(tps[n] for n in names))
    prefill = {n: sum(s["num_prefill_tokens"] for s in runs[n]["steps"]) for n in ("2", *names)}
    nsteps = {n: len(runs[n]["steps"]) for n in ("2", *names)}
    p["why"] = (f"{_direction(p['interference'])}: prompt tokens computed {prefill['2']} (rung 2), "
                f"{prefill[names[0]]} with prefix caching (hit rate {runs[names[0]]['hit_rate']:.0%}), "
                f"{prefill[names[1]]} with chunking, {prefill[names[2]]} with both; engine steps {nsteps['2']}, "
                f"{nsteps[names[0]]}, {nsteps[names[1]]} (budget {budget}), {nsteps[names[2]]}: each step reads all "
                f"the weights once")
    out["prefix_caching_x_chunked_prefill"] = p

    names = ("2 at max_num_seqs 1", "2", "2 at max_num_seqs 1 + speculation", "2 + speculation")
    p = interference(*(tps[n] for n in names))  # A = batching, B = speculation, both over max_num_seqs 1
    alone, full = runs[names[2]], runs[names[3]]
    width = {n: _mean([s["num_tokens"] for s in _decode_steps(runs[n]["steps"])]) for n in names}
    p["why"] = (f"{_direction(p['interference'])}: speculation alone x{p['gain_b']:.2f} (acceptance "
                f"{alone['spec'].acceptance_rate:.2f}, {alone['spec'].tokens_per_step:.2f} tokens per verify), with a "
                f"full batch x{p['gain_ab'] / p['gain_a']:.2f} (acceptance {full['spec'].acceptance_rate:.2f}, "
                f"{full['spec'].tokens_per_step:.2f}); tokens per decode step: {width[names[0]]:.1f} -> "
                f"{width[names[2]]:.1f} alone, {width['2']:.1f} -> {width[names[3]]:.1f} in the batch")
    # the numbers a lesson prices the verify step with: rows per decode step, tokens emitted per sequence per step
    p["rows_per_step"] = {"alone": width[names[0]], "alone + speculation": width[names[2]], "batch": width["2"],
                          "batch + speculation": width[names[3]]}
    p["tokens_per_verify"] = {"alone": alone["spec"].tokens_per_step, "batch": full["spec"].tokens_per_step}
    out["speculation_x_batching"] = p
    return out


def _mean(xs) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")
