"""`minillm bench drafter-domains`: lesson 10's learned head by domain, and the same head tuned on the specialist's
job (issue 41, item 3), verified by the 4-bit target in its native step.

The shipped head accepts ~0.3 on open chat, too few for k guesses to pay; a narrow job answers in a few fixed forms
("The plural of fox is foxes."), which a 3.3M-weight head learns from the target's own answers in CPU minutes. Both
heads draft on held-out prompts of the job and on open chat: acceptance, tokens per step, seconds against
target-only (also without each prompt's prefill), and lesson 10's prediction tokens/step / (d c + v(d + 1))."""

from __future__ import annotations

import copy
import random

import torch

from minillm.bench.speculative import CHAT, head_cost, timed, verify_cost
from minillm.measure.harness import BenchResult


def budget(quick: bool) -> dict:
    if quick:
        return {"train": 24, "stop": 8, "held": 4, "chat": 1, "steps": 4, "k": [3], "new_tokens": 8}
    return {"train": 400, "stop": 48, "held": 32, "chat": 4, "steps": 300, "k": [2, 3, 4], "new_tokens": 48}


def run(quick: bool = False) -> BenchResult:
    from minillm.api import load_model
    from minillm.compress.chat_data import chat_ids
    from minillm.recipes.small_model import answers_path, teacher_answers
    from minillm.recipes.specialist import domain_split
    from minillm.speculative.decoding import SpecStats, SpeculativeConfig
    from minillm.speculative.learned import DRAFTER, load_draft_head, prepare
    from minillm.speculative.train_drafter import guess_accuracy, target_features, train_draft_head

    b, rng = budget(quick), random.Random(0)
    teacher, tok = load_model("smollm2-135m", dtype="float32")  # the shipped head's recipe: float32 features
    split = domain_split("words")
    train = rng.sample([p for p, _, _ in split["train"]], b["train"])
    held = [p for part in ("held_template", "held_entity", "held_both") for p, _, _ in split[part]]
    held = rng.sample(held, b["stop"] + b["held"])
    stop_on, measured = held[:b["stop"]], held[b["stop"]:]
    answers = dict(zip(train + stop_on, teacher_answers(teacher, tok, train + stop_on, max_tokens=32,
                                                        cache=None if quick else answers_path("drafter_words.json"))))

    def features(prompts: list[str]) -> dict:  # guesses start at the last prompt token, as the shipped head's
        ids = [chat_ids(tok, p) for p in prompts]
        return target_features(teacher, [i + answers[p] for i, p in zip(ids, prompts)],
                               first=[len(i) - 1 for i in ids], autocast=False)

    shipped = load_draft_head(DRAFTER)
    tuned = copy.deepcopy(shipped).bind(teacher)
    data, stop_data = features(train), features(stop_on)
    hist = train_draft_head(tuned, data, steps=b["steps"], batch=256, seed=0, noise=0.2, weight_decay=0.1,
                            autocast=False, eval_data=stop_data, eval_every=max(1, b["steps"] // 6))
    top1 = {"shipped": guess_accuracy(shipped.bind(teacher), stop_data, n=1024),
            "tuned": guess_accuracy(tuned, stop_data, n=1024)}
    answer_tokens = [t for p in train for t in answers[p]]
    coverage = sum(t in set(shipped.vocab_ids.tolist()) for t in answer_tokens) / max(len(answer_tokens), 1)

    target = load_model("smollm2-135m", weights="q4", native="auto")[0]  # verify about a decode step (issue 39)
    loads = {"words (held out)": [chat_ids(tok, p) for p in measured],
             "open chat": [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT[:b["chat"]]]}
    cost = head_cost(target)
    c, step_s = cost["c"], cost["step_ms"] / 1e3
    v = {r["q_tokens"]: r["vs_decode"] for r in verify_cost(target, [1, 2, 3, 4, 5])}
    # each prompt's prefill and first token, in both runs alike: the rule below counts decode steps only
    first_token = {load: sum(timed(target, tok, ids, 1, ignore_eos=False)[1] for ids in prompts)
                   for load, prompts in loads.items()}
    rows, identical = [], True
    # prepared once (bound to the target, an int8 copy beside a low-bit one), as draft_head_for does for a name:
    # prepared per call, each short answer would pay the copy
    heads = {"shipped": prepare(target, shipped), "tuned on words": prepare(target, tuned)}
    for name, head in heads.items():
        for k in b["k"]:
            for load, prompts in loads.items():
                t_base = t_spec = 0.0
                stats = SpecStats()
                for ids in prompts:  # to the answer's end (EOS), as a served request stops
                    ref, tb, _ = timed(target, tok, ids, b["new_tokens"], ignore_eos=False)
                    out, ts, _ = timed(target, tok, ids, b["new_tokens"],
                                       SpeculativeConfig("learned", k=k, draft_head=head, max_batch=1),
                                       ignore_eos=False, stats=stats)
                    identical &= out == ref
                    t_base, t_spec = t_base + tb, t_spec + ts
                d, per_step = stats.proposed / max(stats.steps, 1), stats.tokens_per_step
                v_d = v.get(round(d) + 1, v[max(v)])
                rows.append({"head": name, "workload": load, "k": k, "acceptance": stats.acceptance_rate,
                             "drafted_per_step": d, "tokens_per_step": per_step, "target_s": t_base,
                             "spec_s": t_spec, "speedup": t_base / t_spec, "first_token_s": first_token[load],
                             "speedup_after_first_token": (t_base - first_token[load]) / (t_spec - first_token[load]),
                             "predicted_speedup": per_step / (d * c + v_d), "steps": stats.steps,
                             # seconds per step beyond the rule's d c + v(d + 1) decode steps: the loop's own work
                             "unexplained_ms_per_step": ((t_spec - first_token[load]) / max(stats.steps, 1)
                                                         - (d * c + v_d) * step_s) * 1e3})
                print(f"  {name:>15s} k={k} {load:>17s}: a={rows[-1]['acceptance']:.2f} {per_step:.2f} tok/step "
                      f"{t_base / t_spec:.2f}x, {rows[-1]['speedup_after_first_token']:.2f}x after the first token "
                      f"(predicted {rows[-1]['predicted_speedup']:.2f}x; {rows[-1]['unexplained_ms_per_step']:.2f} ms "
                      f"a step beyond the rule's terms)", flush=True)

    def best(head: str, load: str, key: str = "speedup") -> float:
        return max(r[key] for r in rows if r["head"] == head and r["workload"] == load)

    ratios = {"greedy_identical": float(identical),
              "tuned_words_speedup": best("tuned on words", "words (held out)"),
              "shipped_words_speedup": best("shipped", "words (held out)"),
              "tuned_chat_speedup": best("tuned on words", "open chat"),
              "shipped_chat_speedup": best("shipped", "open chat"),
              "tuned_words_acceptance": best("tuned on words", "words (held out)", "acceptance"),
              "shipped_words_acceptance": best("shipped", "words (held out)", "acceptance"),
              "verify_k4_vs_decode": v[5], "head_cost_c": c, "decode_step_ms": step_s * 1e3,
              "tuned_words_unexplained_ms_per_step": max(  # in the row of the best speed
                  (r for r in rows if r["head"] == "tuned on words" and r["workload"] == "words (held out)"),
                  key=lambda r: r["speedup"])["unexplained_ms_per_step"]}
    notes = [f"tuned: the shipped head ({DRAFTER}) trained {b['steps']} more steps (early stopping kept step "
             f"{hist[-1]['best_step']}) on the target's float32 answers to {len(train)} training prompts of the words "
             f"job ({len(answer_tokens)} answer tokens, {coverage:.0%} of them inside the head's "
             f"{len(shipped.vocab_ids)}-token vocabulary); chained top-1 of the first 3 guesses on {len(stop_on)} "
             f"held-out prompts: shipped {[round(a, 2) for a in top1['shipped']]}, tuned "
             f"{[round(a, 2) for a in top1['tuned']]}",
             f"verified by the q4 target in the native step: verify of 5 tokens {v[5]:.2f}x a decode step, one head "
             f"guess c = {c:.3f} of a step; {len(measured)} held-out words prompts and {len(loads['open chat'])} open "
             f"chat prompts, at most {b['new_tokens']} new tokens each ("
             f"to the answer's end), target-only and speculative timed back to back per prompt"]
    return BenchResult(name="drafter-domains", rows=rows, ratios=ratios,
                       targets={"greedy_identical": (">=", 1.0), "tuned_words_speedup": (">=", 1.3)},
                       settings={**b, "threads": torch.get_num_threads()}, notes=notes, series={"top1": top1})
