"""`minillm bench cascade` (lesson 13): a mixed workload routed to the specialist or SmolLM2, per request.

The words specialist (recipes/specialist.py) and SmolLM2 each answer held-out in-domain prompts and open chat once,
greedy, one at a time, alternating. Per request: the classifier's score, the specialist's early confidence after k
tokens, agreement, seconds. `domain_router.policy_cost` gives each policy's agreement and cost on a 50/50 mix and
over every share; one live routed run checks it. Target (issue 41): <= 0.8x always-large at >= 95% agreement.
"""

from __future__ import annotations

import random

import torch

from minillm.measure.harness import BenchResult
from minillm.measure.metrics import timer

KS = (1, 2, 4, 8)


def budget(quick: bool) -> dict:
    if quick:
        return {"n_in": 4, "n_out": 4, "max_tokens": 8, "negatives": 200, "live_check": False}
    return {"n_in": 48, "n_out": 48, "max_tokens": 32, "negatives": 1200, "live_check": True}


def agrees(small_ids: list[int], large_ids: list[int], tok) -> bool:
    """The specialist's answer starts with the large model's first sentence (the specialist's own measure)."""
    from minillm.compress.ability import first_sentence

    target = first_sentence(large_ids, tok)
    return small_ids[:len(target)] == target


def _threshold_for(route: str, k_rows: dict, min_agreement: float = 0.95) -> tuple[int, float, dict] | None:
    """The cheapest (k, early threshold) of `route` on the 50/50 mix reaching min_agreement."""
    from minillm.cluster.domain_router import mixed, policy_cost

    best = None
    for k, (ins, outs) in k_rows.items():
        mix = mixed(ins, outs, 0.5)
        for t in sorted({0.0, *(r.early for r in ins + outs), *(i / 20 for i in range(21))}):
            if t >= 1.0:
                continue
            p = policy_cost(mix, route, 0.5, t)
            if p["agreement"] >= min_agreement and (best is None or p["seconds"] < best[2]["seconds"]):
                best = (k, t, p)
    return best


def measure(quick: bool = False, threads: int = 1) -> dict:
    from minillm.api import load_model
    from minillm.cluster.domain_router import (DomainClassifier, Measured, RoutedCascade, early_confidence,
                                               mixed, policy_cost)
    from minillm.compress.chat_data import chat_ids, chat_prompts, split
    from minillm.engine import LLM
    from minillm.recipes.specialist import NAME, domain_prompts, domain_split, out_of_domain
    from minillm.sampling import SamplingParams

    torch.set_num_threads(threads)
    b = budget(quick)
    rng = random.Random(0)
    large, tok = load_model("smollm2-135m", dtype="float32", device="cpu")
    small, _ = load_model(NAME, dtype="float32", device="cpu")
    parts = domain_split()
    held = [p for k in ("held_template", "held_entity", "held_both") for p, _, _ in parts[k]]
    in_prompts = rng.sample(held, b["n_in"])
    out_prompts = out_of_domain(n=b["n_out"])[:b["n_out"]]
    prompts = [chat_ids(tok, p) for p in in_prompts + out_prompts]
    kinds = [True] * len(in_prompts) + [False] * len(out_prompts)

    # the classifier: the specialist's training prompts against chat of other kinds the general student trained on
    mine = {p for p, _, _ in domain_prompts()}
    negatives = rng.sample([p for p in split(chat_prompts())[0] if p not in mine], b["negatives"])
    with timer() as t_fit:
        clf = DomainClassifier().fit([chat_ids(tok, p) for p, _, _ in parts["train"]],
                                     [chat_ids(tok, p) for p in negatives])
    with timer() as t_score:
        scores = [clf.score(p) for p in prompts]

    params = SamplingParams(max_tokens=b["max_tokens"], logprobs=True)
    engines = {"small": LLM.from_model(small, tok, max_num_seqs=1), "large": LLM.from_model(large, tok,
                                                                                           max_num_seqs=1)}
    for e in engines.values():  # warm-up: first touch of the weights
        e.generate([prompts[0]], SamplingParams(max_tokens=2))
    outs: dict[str, list] = {"small": [], "large": []}
    secs: dict[str, list] = {"small": [], "large": []}
    for i, p in enumerate(prompts):  # the two models alternate which goes first
        for which in (("small", "large") if i % 2 == 0 else ("large", "small")):
            with timer() as t:
                (o,) = engines[which].generate([p], params)
            outs[which].append(o)
            secs[which].append(t.seconds)
    agree = [agrees(s.token_ids, g.token_ids, tok) for s, g in zip(outs["small"], outs["large"])]
    exact = [s.token_ids == g.token_ids for s, g in zip(outs["small"], outs["large"])]

    def rows_at(k: int) -> tuple[list, list]:
        rows = []
        for i, (s, g) in enumerate(zip(outs["small"], outs["large"])):
            early = early_confidence(s.logprobs, k)  # what the live router computes
            # seconds up to the k-th token: its share of the measured wall time, by the engine's token clock
            k_s = secs["small"][i] * s.token_times[min(k, len(s.token_times)) - 1] / s.token_times[-1]
            rows.append(Measured(kinds[i], scores[i], early, agree[i], secs["small"][i], k_s, secs["large"][i]))
        return [r for r in rows if r.in_domain], [r for r in rows if not r.in_domain]

    k_rows = {k: rows_at(k) for k in KS}
    ins, others = k_rows[4]
    mix = mixed(ins, others, 0.5)
    rows, ratios, notes = [], {}, []

    def row(label: str, p: dict, **extra) -> dict:
        r = {"policy": label, "agreement": p["agreement"], "cost_ratio": p["cost_ratio"], "mean_s": p["seconds"],
             "small_share": p["small_share"], **extra}
        rows.append(r)
        return r

    row("always-large", policy_cost(mix, "always_large"))
    row("always-specialist", policy_cost(mix, "always_small"))
    prompt_only = row("prompt classifier (p >= 0.5)", policy_cost(mix, "prompt", 0.5))
    best = {}
    for route in ("early", "both"):
        found = _threshold_for(route, k_rows)
        if found is None:
            notes.append(f"{route}: no k in {KS} and threshold reaches 95% agreement on the 50/50 mix")
            continue
        k, t, p = found
        best[route] = (k, t, p)
        row(f"{'early confidence' if route == 'early' else 'classifier, then early confidence'} (k={k}, "
            f"p_min >= {t:.3g})", p, k=k, early_threshold=t)
    row("oracle router (the specialist takes exactly what it gets right)", policy_cost(mix, "oracle"))

    in_agree = sum(r.agree for r in ins) / len(ins)
    out_agree = sum(r.agree for r in others) / len(others)
    speed = sum(secs["large"]) / sum(secs["small"])
    in_speed = sum(r.large_s for r in ins) / sum(r.small_s for r in ins)
    clf_in = sum(s >= 0.5 for s, k in zip(scores, kinds) if k) / max(1, sum(kinds))
    clf_out = sum(s >= 0.5 for s, k in zip(scores, kinds) if not k) / max(1, len(kinds) - sum(kinds))
    cheapest = min((best[r] for r in best), key=lambda x: x[2]["seconds"], default=None)
    ratios.update({"cost_at_95_agreement_50_50": cheapest[2]["cost_ratio"] if cheapest else 1.0,  # 1: only always-large
                   "agreement_50_50_prompt": prompt_only["agreement"], "cost_50_50_prompt": prompt_only["cost_ratio"],
                   "specialist_agreement_in_domain": in_agree, "specialist_agreement_out_of_domain": out_agree,
                   "specialist_speed_in_domain": in_speed, "specialist_speed_all": speed,
                   "classifier_recall_in_domain": clf_in, "classifier_false_positive": clf_out})
    notes.append(f"specialist alone: agrees with SmolLM2 on {in_agree:.0%} of held-out in-domain prompts and "
                 f"{out_agree:.0%} of open chat; it answers in-domain prompts {in_speed:.2f}x faster (whole "
                 f"requests, one thread)")
    notes.append(f"classifier: {clf_in:.0%} of in-domain prompts and {clf_out:.0%} of open chat scored >= 0.5 "
                 f"(fit {t_fit.seconds:.2f} s on {len(parts['train'])} + {len(negatives)} prompts; "
                 f"{t_score.seconds / len(prompts) * 1e6:.0f} us per prompt)")
    # the cost floor of a perfect router on this mix: the in-domain half at the specialist's cost, the rest large
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    large_in, large_out = mean([r.large_s for r in ins]), mean([r.large_s for r in others])
    floor = (mean([r.small_s for r in ins]) + large_out) / (large_in + large_out)
    ratios["perfect_router_cost_50_50"] = floor
    len_in = mean([len(o.token_ids) for o, k in zip(outs["large"], kinds) if k])
    len_out = mean([len(o.token_ids) for o, k in zip(outs["large"], kinds) if not k])
    notes.append(f"a perfect domain router's cost on the 50/50 mix (every in-domain request to the specialist, "
                 f"nothing else): {floor:.2f}x always-large. SmolLM2's in-domain answers "
                 f"are {len_in:.1f} tokens, its open-chat ones {len_out:.1f}: the in-domain half holds "
                 f"{large_in / (large_in + large_out):.0%} of always-large's seconds, the most any router can save")
    curve = {}
    for label, route, args in (("prompt", "prompt", (0.5, 0.5)), ("oracle", "oracle", (0.5, 0.5)),
                               *((r, r, (0.5, best[r][1])) for r in best)):
        kr = k_rows[best[route][0]] if route in best else k_rows[4]
        curve[label] = [{"share": s / 10, **policy_cost(mixed(*kr, s / 10), route, *args)} for s in range(11)]

    if b["live_check"]:
        route = "both" if "both" in best else "prompt"
        k, t = (best[route][0], best[route][1]) if route in best else (4, 0.5)
        live = RoutedCascade(small, large, tok, route=route, classifier=clf, prompt_threshold=0.5, early_threshold=t,
                             k=k)
        with timer() as t_live:
            answers = live.generate(prompts, SamplingParams(max_tokens=b["max_tokens"]))
        chosen_ok = sum(a.token_ids == (outs["small"][i] if a.answered_by == "small" else outs["large"][i]).token_ids
                        for i, a in enumerate(answers))
        live_agree = sum(agrees(a.token_ids, g.token_ids, tok) for a, g in zip(answers, outs["large"])) / len(answers)
        predicted = policy_cost(k_rows[k][0] + k_rows[k][1], route, 0.5, t)
        ratios["live_agreement"] = live_agree
        ratios["live_cost_ratio"] = t_live.seconds / sum(secs["large"])
        rows.append({"policy": f"live routed run ({route}, k={k}, p_min >= {t:.3g})", "agreement": live_agree,
                     "cost_ratio": ratios["live_cost_ratio"], "mean_s": t_live.seconds / len(prompts),
                     "small_share": sum(a.answered_by == "small" for a in answers) / len(answers)})
        notes.append(f"live run: {chosen_ok}/{len(answers)} answers equal the chosen model's own; agreement "
                     f"{live_agree:.0%} (predicted {predicted['agreement']:.0%}), cost {ratios['live_cost_ratio']:.2f}x"
                     f" (predicted {predicted['cost_ratio']:.2f}x)")
    series = {"curve": curve, "per_request": [
        {"prompt": (in_prompts + out_prompts)[i], "in_domain": kinds[i], "score": scores[i],
         "small": outs["small"][i].text, "large": outs["large"][i].text, "agree": agree[i], "exact": exact[i],
         "small_s": secs["small"][i], "large_s": secs["large"][i],
         "early": {k: k_rows[k][0 if kinds[i] else 1][(i if kinds[i] else i - sum(kinds))].early for k in KS}}
        for i in range(len(prompts))]}
    return {"rows": rows, "ratios": ratios, "notes": notes, "series": series,
            "targets": {"cost_at_95_agreement_50_50": ("<=", 0.80)},
            "settings": {"small": NAME, "in_domain": len(in_prompts), "open_chat": len(out_prompts),
                         "max_tokens": b["max_tokens"], "threads": threads, "dtype": "float32", "greedy": True}}


def run(quick: bool = False, threads: int = 1) -> BenchResult:
    out = measure(quick=quick, threads=threads)
    return BenchResult(name="cascade", rows=out["rows"], ratios=out["ratios"], targets=out["targets"],
                       settings={**out["settings"], "quick": quick, "device": "cpu"}, notes=out["notes"],
                       series=out["series"], quick=quick)
