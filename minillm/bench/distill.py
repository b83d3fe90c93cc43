"""`minillm bench distill` (lesson 09): a student sized by measurement, that keeps the teacher's answers.

Students are the teacher minus the blocks whose removal costs least (KL on the teacher's answers, one at a time),
keeping 24 / 20 / 16 of 30, recovered with LoRA by ability-transfer KD on the teacher's answers to templated chat
prompts. Per row, a DistilBERT-style table: parameters, decode tok/s, perplexity and KL on held-apart text, and
retained ability on held-out prompts. The shipped size trains on to the full budget and ships as a few-MB recipe
(recipes/student.py) instead of a full model: load_model rebuilds the student from it.
"""

from __future__ import annotations

import copy
import math
import os
import random

import torch

from minillm.measure.hardware import native_bf16
from minillm.measure.harness import BenchResult, paired_ratio
from minillm.measure.metrics import decode_tok_s, timer


def budget(quick: bool) -> dict:
    if quick:
        return {"sizes": [16], "ship_size": 16, "sweep_steps": 1, "final_steps": 2, "batch_size": 2, "seq_len": 96,
                "n_prompts": 12, "n_heldout": 4, "max_answer": 12, "eval_tokens": 64, "lora_rank": 4,
                "compare": False, "ship": False, "calib_examples": 1, "calib_cut": (8, 4), "speed_tries": 1}
    return {"sizes": [24, 20, 16], "ship_size": 16, "sweep_steps": 50, "final_steps": 300, "batch_size": 8,
            "seq_len": 320, "n_prompts": None, "n_heldout": 96, "max_answer": 64, "eval_tokens": 512,
            "lora_rank": 32, "compare": True, "ship": True, "calib_examples": 8}


def chat_data(teacher, tok, b: dict) -> tuple[list, list, dict]:
    """(train examples, held-out examples, facts): the teacher's answers to the templated prompts (cached)."""
    from minillm.recipes.small_model import answers_path, teacher_answers
    from minillm.compress.chat_data import ALWAYS_HELD_OUT, chat_ids, chat_prompts, is_held_out, split

    prompts = chat_prompts()
    if b["n_prompts"]:  # quick: a few of each kind
        prompts = ([p for p in prompts if is_held_out(p)][:b["n_heldout"]]
                   + [p for p in prompts if not is_held_out(p)][:b["n_prompts"]])
    cache = answers_path() if b["n_prompts"] is None else answers_path(f"teacher_answers_{b['n_prompts']}.json")
    answers = dict(zip(prompts, teacher_answers(teacher, tok, prompts, b["max_answer"], cache=cache,
                                                progress=b["ship"])))
    train, held = split(prompts)
    if not b["n_prompts"]:  # the measured held-out set: every prompt a lesson measures on, then a seeded sample
        rest = [p for p in held if p not in ALWAYS_HELD_OUT]
        held = [p for p in held if p in ALWAYS_HELD_OUT] + random.Random(0).sample(rest, b["n_heldout"])
    ex = lambda ps: [(chat_ids(tok, p), answers[p]) for p in ps if answers[p]]  # noqa: E731
    facts = {"prompts": len(prompts), "train_prompts": len(train), "heldout_measured": len(held),
             "answer_tokens": sum(len(answers[p]) for p in train)}
    return ex(train), ex(held), facts


def measure(student, teacher, tok, held: list, ev: torch.Tensor, prompt: list[int], n_decode: int,
            tries: int = 3) -> dict:
    from minillm.recipes.small_model import retained_ability
    from minillm.compress.distill import evaluate
    from minillm.compress.pruning import n_params

    ability = retained_ability(student, tok, held)
    speed = max(decode_tok_s(student, prompt, n_decode)[0] for _ in range(tries))
    return {**evaluate(student, teacher, ev), "answer_match": ability["answer_match"],
            "answer_top1": ability["top1_agree"], "params_M": n_params(student) / 1e6,
            "blocks": student.config.n_layers, "decode_tok_s": speed}


def by_name(rows: list[dict], name: str) -> dict:
    return next(r for r in rows if r["variant"] == name)


def merged(student):
    from minillm.compress.lora import merge_lora

    return merge_lora(copy.deepcopy(student)).eval()


def run(quick: bool = False) -> BenchResult:
    """Teacher SmolLM2-135M-Instruct. Blocks dropped by pruning.greedy_block_drop (lesson 08's one-shot block
    importance is measured beside it, as the untrained start it would give); adapters from compress/lora.py, trained
    by compress/ability.py on the teacher's greedy answers to ~2,100 prompts plus plain-text KD steps. Every size
    trains the same steps on the same batches; at the size that ships, the same budget also trains (a) standard
    text-only KD and (b) every weight instead of adapters. Retained ability: the share of greedy answers that start
    with the teacher's first sentence, and top-1 agreement on the teacher's answers. The speed target is measured in
    interleaved teacher/student pairs. Not quick: writes minillm/assets/smollm2-135m-student.pt (+ .json)."""
    from minillm.api import load_model
    from minillm.compress.ability import AbilityConfig, answer_batch, distill_ability
    from minillm.compress.distill import train_ids
    from minillm.compress.lora import add_lora
    from minillm.compress.pruning import block_importance, drop_blocks, greedy_block_drop, least_important
    from minillm.compress.quality import calibration_ids, eval_ids
    from minillm.gguf.weights import cache_dir
    from minillm.recipes.student import ship_student

    b = budget(quick)
    torch.manual_seed(0)
    teacher, tok = load_model("smollm2-135m", dtype="float32")
    train, held, facts = chat_data(teacher, tok, b)
    text = train_ids(tok)
    ev = torch.tensor(eval_ids(tok, b["eval_tokens"] + 1))
    prompt = eval_ids(tok, 32)
    n_decode = 8 if quick else 64
    tries = b.get("speed_tries", 3)  # decode timings per row (the best is kept)
    autocast = native_bf16(teacher.device)
    n_blocks = teacher.config.n_layers
    # which blocks go: one at a time, by the KL each removal costs on a few training answers (never held-out ones)
    calib = random.Random(1).sample(train, b["calib_examples"])
    if b.get("calib_cut"):  # quick: score on the prompt's last tokens and the answer's first ones (a round is O(n^2))
        calib = [(p[-b["calib_cut"][0]:], a[:b["calib_cut"][1]]) for p, a in calib]
    with timer() as t_sel:
        x, mask = answer_batch(calib, tok.eos_id)  # the positions that predict answer tokens are scored
        order = greedy_block_drop(teacher, x[:, :-1], n_blocks - min(b["sizes"]), mask)
    dropped = {keep: sorted(order[:n_blocks - keep]) for keep in b["sizes"]}
    one_shot = least_important(block_importance(teacher, calibration_ids(tok, 256)), n_blocks - b["ship_size"])

    def student_of(keep: int, lora: bool = True, drop: list[int] | None = None):
        s = drop_blocks(copy.deepcopy(teacher), dropped[keep] if drop is None else drop)
        if lora:
            add_lora(s, rank=b["lora_rank"], alpha=2.0 * b["lora_rank"])
        else:
            s.requires_grad_(True)
            s.embed.weight.requires_grad_(False)  # the tied 28M embedding/head stays the teacher's
        return s

    def config(**kw) -> AbilityConfig:
        kw = {"lora_rank": b["lora_rank"], **kw}
        return AbilityConfig(steps=b["final_steps"], batch_size=b["batch_size"], seq_len=b["seq_len"], warmup=10,
                             lr=2e-3 if kw["lora_rank"] else 3e-4, kd=1.0, ce=1.0, temperature=1.0,
                             autocast=autocast, checkpoint_every=20, eval_every=10**9, **kw)

    def fit(name: str, student, cfg: AbilityConfig, steps: int, checkpoint=None) -> dict:
        print(f"  {name}: {steps} steps", flush=True)
        with timer() as t:
            hist = distill_ability(student, teacher, train, text, cfg, tok.eos_id, checkpoint=checkpoint,
                                   progress=not quick, stop_after=steps)
        row = {"variant": name, **measure(merged(student), teacher, tok, held, ev, prompt, n_decode, tries),
               "train_s": t.seconds, "train_steps": hist[-1]["step"],
               "train_tokens": sum(h["tokens"] for h in hist), "loss_tokens": sum(h["loss_tokens"] for h in hist)}
        curves[name] = [{k: h[k] for k in ("step", "kind", "loss", "ce")} for h in hist]
        print(f"    answer match {row['answer_match']:.2f}  top-1 {row['answer_top1']:.2f}  ppl {row['ppl']:.1f}  "
              f"{row['decode_tok_s']:.1f} tok/s  ({t.seconds / 60:.1f} min)", flush=True)
        return row

    curves: dict = {}
    rows = [{"variant": "teacher", **measure(teacher, teacher, tok, held, ev, prompt, n_decode, tries)}]
    ship = b["ship_size"]
    untrained = lambda drop=None: student_of(ship, False, drop).eval().requires_grad_(False)  # noqa: E731
    rows.append({"variant": f"keep {ship}, untrained (one-shot importance)",
                 **measure(untrained(one_shot), teacher, tok, held, ev, prompt, n_decode, tries), "dropped": one_shot})
    rows.append({"variant": f"keep {ship}, untrained", **measure(untrained(), teacher, tok, held, ev, prompt,
                                                                 n_decode, tries), "dropped": dropped[ship],
                 "selection_s": t_sel.seconds})
    ckpt = cache_dir() / "distill" / f"ability_keep{ship}{'_quick' if quick else ''}.pt"
    if ckpt.exists():
        os.remove(ckpt)  # a bench run starts from the pruned student; resume is for an interrupted run (tests)
    students = {}
    for keep in b["sizes"]:
        students[keep] = student_of(keep)
        rows.append(fit(f"keep {keep}, ability KD (LoRA)", students[keep], config(), b["sweep_steps"],
                          ckpt if keep == ship else None))
    if b["compare"]:
        rows.append(fit(f"keep {ship}, text-only KD (LoRA)", student_of(ship), config(text_share=1.0),
                          b["sweep_steps"]))  # windows of text_len tokens: about a chat example's length
        rows.append(fit(f"keep {ship}, ability KD (all weights)", student_of(ship, False), config(lora_rank=0),
                          b["sweep_steps"]))
    final = fit(f"keep {ship}, ability KD (LoRA), shipped", students[ship], config(), b["final_steps"]
                  - b["sweep_steps"], ckpt)
    final["train_s"] += by_name(rows, f"keep {ship}, ability KD (LoRA)")["train_s"]  # the sweep's steps included
    rows.append(final)
    by = {r["variant"]: r for r in rows}
    if b["ship"]:
        ship_student(students[ship], dropped[ship], {"budget": dict(b), "data": facts, "eval": {
            k: v for k, v in final.items() if isinstance(v, (int, float, str))}})
    # the speed target from interleaved pairs: each row's best-of-3 is measured minutes apart on a shared machine
    shipped = merged(students[ship])
    pair = paired_ratio(lambda: decode_tok_s(teacher, prompt, n_decode),
                        lambda: decode_tok_s(shipped, prompt, n_decode), pairs=2 if quick else 7)
    t, u = by["teacher"], by[f"keep {ship}, untrained"]
    log_gap = (math.log(u["ppl"]) - math.log(final["ppl"])) / (math.log(u["ppl"]) - math.log(t["ppl"]))
    ratios = {"student_decode_vs_teacher": pair.median,
              "rows_decode_vs_teacher": final["decode_tok_s"] / t["decode_tok_s"],
              "student_answer_match": final["answer_match"], "student_top1_on_answers": final["answer_top1"],
              "student_params_vs_teacher": final["params_M"] / t["params_M"],
              "ppl_gap_closed": (u["ppl"] - final["ppl"]) / (u["ppl"] - t["ppl"]), "log_ppl_gap_closed": log_gap}
    targets = {"student_decode_vs_teacher": (">=", 1.5), "student_answer_match": (">=", 0.5),
               "student_top1_on_answers": (">=", 0.7)}
    if b["compare"]:
        ab, tx = by[f"keep {ship}, ability KD (LoRA)"], by[f"keep {ship}, text-only KD (LoRA)"]
        full = by[f"keep {ship}, ability KD (all weights)"]
        # a difference, not a ratio: at a small budget text-only KD can match no answer at all (a 0 denominator)
        ratios.update({"ability_minus_text_answer_match": ab["answer_match"] - tx["answer_match"],
                       "ability_minus_text_top1": ab["answer_top1"] - tx["answer_top1"],
                       "lora_over_full_answer_match_per_minute": (ab["answer_match"] / ab["train_s"])
                       / max(full["answer_match"] / full["train_s"], 1e-9)})
        targets["ability_minus_text_answer_match"] = (">", 0.0)
    one = by[f"keep {ship}, untrained (one-shot importance)"]
    ratios["selection_start_ppl_one_shot_over_greedy"] = one["ppl"] / u["ppl"]
    notes = [f"students: the teacher minus the blocks chosen one at a time by the KL their removal costs on "
             f"{b['calib_examples']} training answers (greedy_block_drop, {t_sel.seconds:.0f} s), e.g. keep {ship} "
             f"drops {dropped[ship]} (start: ppl {u['ppl']:.0f}); lesson 08's one-shot block importance would drop "
             f"{one_shot} (start: ppl {one['ppl']:.0f}); LoRA rank {b['lora_rank']} on every block matmul + the "
             f"block norms; the tied embedding/LM head stays the teacher's" + (
                 f" (quick: scored on each answer's first {b['calib_cut'][1]} tokens after the prompt's last "
                 f"{b['calib_cut'][0]})" if b.get("calib_cut") else ""),
             f"data: {facts['train_prompts']} training prompts ({facts['answer_tokens']} teacher answer tokens), "
             f"{facts['heldout_measured']} held-out prompts measured (never trained on); 25% of steps are plain-text "
             f"KD on pydoc; batch {b['batch_size']}; every sweep row {b['sweep_steps']} steps, the shipped student "
             f"{b['final_steps']}",
             f"float32 weights, bf16 autocast {'on (native bf16)' if autocast else 'off'} for training; decode "
             f"tok/s at batch 1, float32, best of {tries} per row; the speed target from {len(pair.ratios)} "
             f"interleaved teacher/student pairs (median; per pair {[round(r, 2) for r in pair.ratios]})"]
    return BenchResult(name="distill", rows=rows, ratios=ratios, targets=targets,
                       settings={k: v for k, v in b.items() if not isinstance(v, list)} | {
                           "threads": torch.get_num_threads(), "autocast": autocast,
                           "heldout_measured": facts["heldout_measured"]}, notes=notes, series=curves)
