"""Part "cascade" of `minillm bench disagg` (lesson 13): the small model answers first, SmolLM2 when unsure.

Large: SmolLM2-135M. Small: lesson 09's distilled student ("smollm2-135m-student") when saved on this machine,
else an untrained early-exit stand-in (the notes say which). Both answer a fixed set of short chat questions,
greedy, one at a time; `minillm.cluster.cascade.sweep` turns those answers into the cascade at every
threshold, per confidence signal: agreement with the large model vs mean cost (seconds, FLOPs), escalation
rate. A perfect-signal row bounds what any signal can reach; one live cascade run checks the sweep. Target:
>= 95% agreement at <= 70% of the cost.
"""

from __future__ import annotations

import torch

from minillm.measure.metrics import timer
from minillm.compress.chat_data import CASCADE_QUESTIONS

QUESTIONS = CASCADE_QUESTIONS  # held out of the student's training (compress/chat_data.py)


def budget(quick: bool) -> dict:
    if quick:
        return {"n_prompts": 6, "max_tokens": 8, "repeats": 1, "live_check": False}
    return {"n_prompts": len(QUESTIONS), "max_tokens": 32, "repeats": 2, "live_check": True}


def best_point(curve: list[dict], min_agreement: float = 0.95) -> dict | None:
    """The cheapest point (in seconds) that is a real cascade (threshold < 1) with agreement >= min_agreement and
    cheaper than always-large (escalating nearly everything costs more than skipping the small model)."""
    ok = [p for p in curve if p["threshold"] < 1.0 and p["agreement"] >= min_agreement and p["seconds_ratio"] < 1.0]
    return min(ok, key=lambda p: (p["seconds_ratio"], -p["agreement"])) if ok else None


def _row(label: str, signal: str, p: dict) -> dict:
    return {"model": label, "signal": signal, "threshold": round(p["threshold"], 4),
            "agreement": p["agreement"], "prefix_agreement": p["prefix_agreement"], "kl": p["kl"],
            "escalation_rate": p["escalation_rate"], "mean_s": p["seconds"], "seconds_ratio": p["seconds_ratio"],
            "mean_gflop": p["flops"] / 1e9, "flops_ratio": p["flops_ratio"]}


def measure(quick: bool = False, threads: int = 1) -> dict:
    from minillm.cluster.cascade import SIGNALS, Cascade, Outcome, answer_kl, escalates, load_small, outcomes, sweep
    from minillm.api import load_model
    from minillm.sampling import SamplingParams

    torch.set_num_threads(threads)
    b = budget(quick)
    large, tok = load_model("smollm2-135m", dtype="float32", device="cpu")
    small, small_desc = load_small(large)
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS[:b["n_prompts"]]]
    params = SamplingParams(max_tokens=b["max_tokens"])
    cascade = Cascade(small, large, tok)
    for which in ("small", "large"):  # warm-up: first touch of the weights
        cascade.answer(which, prompts[:1], SamplingParams(max_tokens=2))

    answers: dict[str, list] = {"small": [None] * len(prompts), "large": [None] * len(prompts)}
    # the two models alternate per question (a slow moment of a shared machine hits both); a request's seconds are
    # its best over the repeats
    for rep in range(b["repeats"]):
        for i, prompt in enumerate(prompts):
            for which in (("small", "large") if (rep + i) % 2 == 0 else ("large", "small")):
                (a,) = cascade.answer(which, [prompt], params)
                old = answers[which][i]
                if old is not None and old.token_ids != a.token_ids:
                    raise RuntimeError(f"the {which} model's greedy answer to prompt {i} changed between repeats")
                if old is None or a.seconds < old.seconds:
                    answers[which][i] = a
    small_ans, large_ans = answers["small"], answers["large"]
    kls = [answer_kl(small, large, p, a.token_ids) for p, a in zip(prompts, large_ans)]

    rows, series, ratios, notes = [], {"curve": {}}, {}, [f"small model: {small_desc}"]
    best: tuple[float, str, dict] | None = None
    halfway = None  # the live run's threshold when no cascade reaches the target: mean_logprob, ~half escalated
    for signal in SIGNALS:
        curve = sweep(outcomes(small_ans, large_ans, signal, kls))
        series["curve"][signal] = curve
        if signal == SIGNALS[0]:
            rows.append(_row("always-small", "-", curve[0]))
            rows.append(_row("always-large", "-", curve[-1]))
        # a few points along the curve: the thresholds that escalate about a quarter, half, three quarters
        inner, shown = [p for p in curve if 0 < p["threshold"] < 1], set()
        for target_rate in (0.25, 0.5, 0.75):
            p = min(inner, key=lambda p: abs(p["escalation_rate"] - target_rate), default=None)
            if p is not None and p["threshold"] not in shown:  # few prompts: two rates can pick one point
                shown.add(p["threshold"])
                rows.append(_row(f"cascade ~{target_rate:.0%} escalated", signal, p))
                if halfway is None and target_rate == 0.5:
                    halfway = (p["seconds_ratio"], signal, p)
        p = best_point(curve)
        if p is not None:
            rows.append(_row("cascade, cheapest >= 95% agreement", signal, p))
            if best is None or p["seconds_ratio"] < best[0]:
                best = (p["seconds_ratio"], signal, p)
        ratios[f"cost_ratio_at_95_{signal}"] = p["seconds_ratio"] if p is not None else 1.0

    # the best any signal could do: escalate exactly the answers that disagree (confidence 0), keep the rest (1)
    perfect = [Outcome(**{**o.__dict__, "confidence": float(o.exact)}) for o in outcomes(small_ans, large_ans,
                                                                                     SIGNALS[0], kls)]
    rows.append(_row("perfect signal (escalates exactly the disagreements)", "oracle", sweep(perfect, [0.5])[0]))
    n = len(prompts)
    small_ratio = sum(a.seconds for a in small_ans) / sum(a.seconds for a in large_ans)
    agree_small = sum(s.token_ids == big.token_ids for s, big in zip(small_ans, large_ans)) / n
    ratios.update({
        "cost_ratio_at_95_agreement": best[0] if best else 1.0,  # 1.0: only always-large reaches 95%
        "always_small_agreement": agree_small,
        "small_vs_large_seconds": small_ratio,
        "small_vs_large_flops": sum(a.flops for a in small_ans) / sum(a.flops for a in large_ans),
        # a perfect signal escalates exactly the disagreements, leaving up to 5% of them unescalated
        "perfect_signal_cost_ratio_at_95": small_ratio + max(0.0, 1 - agree_small - 0.05),
    })
    if best is None:
        notes.append(f"no threshold below 1 keeps >= 95% agreement below always-large's cost: the small model "
                     f"agrees on {agree_small:.0%} of the answers and costs {small_ratio:.0%} of the large one, so "
                     f"every escalated request pays {1 + small_ratio:.2f}x; even a perfect signal would cost "
                     f"{ratios['perfect_signal_cost_ratio_at_95']:.0%} of always-large at 95%")
    if agree_small < 0.5:
        i = next((i for i, (s, big) in enumerate(zip(small_ans, large_ans)) if s.token_ids != big.token_ids), 0)
        notes.append(f"e.g. {QUESTIONS[i]!r}: small {small_ans[i].text!r}, large {large_ans[i].text!r}")
    if best is not None and best[0] > 0.80:
        notes.append(f"the cheapest cascade at >= 95% agreement ({best[1]}, threshold {best[2]['threshold']:.3g}) "
                     f"costs {best[0]:.0%} of always-large: the small model alone costs {small_ratio:.0%} and agrees "
                     f"on {agree_small:.0%}")

    check = best or halfway
    if b["live_check"] and check is not None:  # run the cascade for real at one threshold: does the sweep hold?
        _, signal, point = check
        live = Cascade(small, large, tok, signal=signal, threshold=point["threshold"])
        with timer() as t:
            results = live.generate(prompts, params)
        wall = t.seconds
        predicted = [escalates(a.confidence(signal), point["threshold"]) for a in small_ans]
        same = sum(r.token_ids == (big.token_ids if e else s.token_ids)
                   for r, e, s, big in zip(results, predicted, small_ans, large_ans))
        ratios["live_vs_sweep_seconds"] = wall / n / point["seconds"]
        rows.append({"model": "cascade, live run", "signal": signal, "threshold": round(point["threshold"], 4),
                     "agreement": sum(r.token_ids == big.token_ids for r, big in zip(results, large_ans)) / n,
                     "escalation_rate": sum(r.escalated for r in results) / n, "mean_s": wall / n,
                     "seconds_ratio": wall / n / (sum(a.seconds for a in large_ans) / n),
                     "mean_gflop": sum(r.flops for r in results) / n / 1e9})
        notes.append(f"live cascade run ({signal}, threshold {point['threshold']:.3g}): {same}/{n} answers and "
                     f"{sum(r.escalated == e for r, e in zip(results, predicted))}/{n} escalations as the sweep "
                     f"predicted; its mean seconds {wall / n:.2f} vs the sweep's {point['seconds']:.2f}")
    series["per_request"] = [
        {"question": QUESTIONS[i], "small": s.text, "large": big.text, "exact": s.token_ids == big.token_ids,
         "kl": kls[i], "small_s": s.seconds, "large_s": big.seconds,
         **{f"conf_{sig}": s.confidence(sig) for sig in SIGNALS}}
        for i, (s, big) in enumerate(zip(small_ans, large_ans))]
    return {"rows": rows, "ratios": ratios, "targets": {"cost_ratio_at_95_agreement": ("<=", 0.80)},
            "notes": notes, "series": series,
            "settings": {"small": small_desc, "prompts": n, "max_tokens": b["max_tokens"], "repeats": b["repeats"],
                         "threads": threads, "dtype": "float32", "greedy": True}}
