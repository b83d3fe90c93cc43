"""A specialist student (lessons 09 and 13): the general student's pruned start, distilled on ONE narrow job.

The general student (recipes/student.py) must keep all of the teacher's abilities in half its blocks and matches its
first sentence on ~12% of new chat prompts. A small model can match a large one on the job it was made for: trained
only on country facts, the same 16-block student answers like the teacher on templates and countries it never saw,
at the student's decode speed, removing the teacher's cost for that job (lesson 13's cascade routes it there).

    python -m minillm.recipes.specialist   # CPU minutes: -> minillm/assets/, results/specialist.json
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch

from minillm.compress.chat_data import ALWAYS_HELD_OUT, COUNTRIES, chat_ids, chat_prompts, is_held_out

NAME = "smollm2-135m-specialist-countries"
GENERAL = "smollm2-135m-student"
MORE_COUNTRIES = ["Bolivia", "Venezuela", "Ecuador", "Uruguay", "Paraguay", "Romania", "Bulgaria", "Serbia",
                  "Croatia", "the Netherlands", "Czechia", "Slovakia", "Lithuania", "Latvia", "Estonia",
                  "Saudi Arabia", "Jordan", "Syria", "Lebanon", "Afghanistan", "Bangladesh", "Sri Lanka",
                  "Malaysia", "the Philippines", "Singapore", "Cambodia", "Mongolia", "Kazakhstan", "Algeria",
                  "Tunisia", "Libya", "Sudan", "Tanzania", "Uganda", "Senegal", "Cameroon", "Zimbabwe", "Angola",
                  "Madagascar", "Haiti", "Panama", "Costa Rica", "Guatemala", "Honduras", "Qatar", "Belarus"]
# (fact, phrasing): several phrasings per fact, so a phrasing held out of training asks a fact the student learned
DOMAINS: dict[str, dict] = {
    "countries": {"entities": COUNTRIES + MORE_COUNTRIES, "templates": [
        ("capital", "What is the capital of {}?"), ("capital", "Which city is the capital of {}?"),
        ("capital", "Name the capital city of {}."), ("language", "What language is spoken in {}?"),
        ("language", "What is the main language of {}?"), ("continent", "What continent is {} in?"),
        ("continent", "On which continent is {}?"), ("currency", "What currency is used in {}?"),
        ("currency", "What is the currency of {}?")]},
}


def domain_prompts(domain: str = "countries") -> list[tuple[str, int, str]]:
    """Every (prompt, template id, entity) of `domain`, in a fixed order."""
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}: the specialist knows {sorted(DOMAINS)}")
    d = DOMAINS[domain]
    return [(t.format(e), i, e) for e in d["entities"] for i, (_, t) in enumerate(d["templates"])]


def held_out_parts(domain: str = "countries", template_share: float = 0.25, entity_share: float = 0.25,
                   seed: int = 0) -> tuple[set[int], set[str]]:
    """(held-out template ids, held-out entities), drawn from `seed`. At most one phrasing per fact is held out (the
    skill, not an untaught fact, is measured); an entity that lessons 10/13 measure on is always held out."""
    for what, share in (("template_share", template_share), ("entity_share", entity_share)):
        if not 0 < share < 1:
            raise ValueError(f"{what} must be in (0, 1), got {share!r}")
    prompts, d = domain_prompts(domain), DOMAINS[domain]
    rng = random.Random(seed)
    facts: dict[str, list[int]] = {}
    for i, (fact, _) in enumerate(d["templates"]):
        facts.setdefault(fact, []).append(i)
    can = [rng.choice(ids) for ids in facts.values() if len(ids) > 1]
    n_t = max(1, min(len(can), round(template_share * len(d["templates"]))))
    templates = set(rng.sample(can, n_t))
    always = {e for p, _, e in prompts if p in ALWAYS_HELD_OUT}
    rest = [e for e in d["entities"] if e not in always]
    n_e = max(0, round(entity_share * len(d["entities"])) - len(always))
    return templates, always | set(rng.sample(rest, n_e))


def domain_split(domain: str = "countries", template_share: float = 0.25, entity_share: float = 0.25,
                 seed: int = 0) -> dict[str, list[tuple[str, int, str]]]:
    """{"train", "held_template", "held_entity", "held_both"}: the domain's (prompt, template id, entity), split so
    that training sees no held-out phrasing and no held-out entity; the three held-out parts are in-domain held-out."""
    templates, entities = held_out_parts(domain, template_share, entity_share, seed)
    out: dict[str, list] = {"train": [], "held_template": [], "held_entity": [], "held_both": []}
    for row in domain_prompts(domain):
        key = {(False, False): "train", (True, False): "held_template", (False, True): "held_entity",
               (True, True): "held_both"}[(row[1] in templates, row[2] in entities)]
        out[key].append(row)
    return out


def out_of_domain(domain: str = "countries", n: int = 64, seed: int = 0) -> list[str]:
    """Chat prompts of other kinds, held out of the general student's training too: every prompt lessons 10/13
    measure on, then a seeded sample of the rest of chat_data's held-out split (none of the domain's prompts)."""
    mine = {p for p, _, _ in domain_prompts(domain)}
    held = [p for p in chat_prompts() if is_held_out(p) and p not in mine]
    first = [p for p in held if p in ALWAYS_HELD_OUT]
    rest = [p for p in held if p not in ALWAYS_HELD_OUT]
    return (first + random.Random(seed).sample(rest, max(0, n - len(first))))[:max(n, len(first))]


# ----------------------------------------------------------------------------------------------- the recipe

# a laptop's CPU minutes: 80 steps of 8 short examples (~30k tokens through teacher and student)
BUDGET = {"steps": 80, "batch_size": 8, "seq_len": 96, "lora_rank": 16, "lr": 2e-3, "max_answer": 48,
          "checkpoints": [20, 40, 80], "curve_prompts": 24, "seen_measured": 32, "ood_measured": 48,
          "teacher_measured": 16, "heldout_measured": 96, "decode_pairs": 3}  # None: every held-out prompt


def pruned_start(teacher, rank: int):
    """(student, dropped blocks): the general student's start, the teacher minus the blocks its recipe drops, with
    fresh LoRA adapters (rank `rank`) on every block matmul and trainable block norms."""
    import copy

    from minillm.compress.lora import add_lora
    from minillm.compress.pruning import drop_blocks
    from minillm.gguf.saved import recipe_path

    dropped = json.loads(Path(f"{recipe_path(GENERAL)}.json").read_text())["dropped_blocks"]
    student = drop_blocks(copy.deepcopy(teacher), list(dropped))
    add_lora(student, rank=rank, alpha=2.0 * rank)
    return student, list(dropped)


def merged(student):
    import copy

    from minillm.compress.lora import merge_lora

    return merge_lora(copy.deepcopy(student)).eval()


def agreement(model, tok, examples: list) -> dict:
    """answer_match (greedy answer starts with the teacher's first sentence) and top-1 on the teacher's answers."""
    from minillm.recipes.small_model import retained_ability

    r = retained_ability(model, tok, examples)
    return {"answer_match": r["answer_match"], "top1_agree": r["top1_agree"], "n": r["n_prompts"],
            "matched": r["matched"]}


def decode_speed(model, teacher, ids: list[int], n_new: int = 64, pairs: int = 5) -> dict:
    """Decode tok/s at batch 1 on one thread, model and teacher timed in interleaved pairs (the order alternates)."""
    from minillm.measure.metrics import decode_tok_s

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        decode_tok_s(model, ids, 8), decode_tok_s(teacher, ids, 8)  # warm-up
        mine, ref = [], []
        for i in range(pairs):
            for which in ((mine, model), (ref, teacher)) if i % 2 == 0 else ((ref, teacher), (mine, model)):
                which[0].append(decode_tok_s(which[1], ids, n_new)[0])
    finally:
        torch.set_num_threads(threads)
    ratios = sorted(a / b for a, b in zip(mine, ref))
    return {"specialist_tok_s": sorted(mine)[pairs // 2], "teacher_tok_s": sorted(ref)[pairs // 2],
            "ratio_median": ratios[pairs // 2], "ratios": ratios, "pairs": pairs, "n_new": n_new, "threads": 1}


def run(domain: str = "countries", budget: dict | None = None, out: str | Path = "results/specialist.json",
        ship: bool = True, seed: int = 0) -> dict:
    """Teacher answers -> train the specialist (curve at b["checkpoints"]) -> ship it -> measure all three models on
    the three sets -> results JSON. Every held-out prompt is one the specialist never trained on."""
    from minillm.api import load_model
    from minillm.compress.ability import AbilityConfig, distill_ability
    from minillm.gguf.weights import cache_dir
    from minillm.measure.hardware import native_bf16
    from minillm.recipes.small_model import answers_path, teacher_answers
    from minillm.recipes.student import ship_student

    b = {**BUDGET, **(budget or {})}
    torch.manual_seed(seed)
    teacher, tok = load_model("smollm2-135m", dtype="float32")
    parts = domain_split(domain, seed=seed)
    ood = out_of_domain(domain, b["ood_measured"], seed)
    prompts = [p for p, _, _ in domain_prompts(domain)]  # the cache's key: this order
    answers = dict(zip(prompts, teacher_answers(teacher, tok, prompts, b["max_answer"],
                                                cache=answers_path(f"specialist_{domain}_answers.json"))))
    answers.update(zip(ood, teacher_answers(teacher, tok, ood, 64, cache=answers_path("specialist_ood.json"))))
    ex = lambda ps: [(chat_ids(tok, p), answers[p]) for p in ps if answers[p]]  # noqa: E731
    held_rows = [(p, k) for k in ("held_template", "held_entity", "held_both") for p, _, _ in parts[k] if answers[p]]
    train = ex([p for p, _, _ in parts["train"]])
    rng = random.Random(seed)
    if b["heldout_measured"] is not None:  # a seeded sample, of every kind
        held_rows = rng.sample(held_rows, min(b["heldout_measured"], len(held_rows)))
    sets = {"in_domain_heldout": ex([p for p, _ in held_rows]),
            "in_domain_seen": rng.sample(train, min(b["seen_measured"], len(train))), "out_of_domain": ex(ood)}
    curve_set = rng.sample(sets["in_domain_heldout"], min(b["curve_prompts"], len(sets["in_domain_heldout"])))

    student, dropped = pruned_start(teacher, b["lora_rank"])
    cfg = AbilityConfig(steps=b["steps"], batch_size=b["batch_size"], seq_len=b["seq_len"], warmup=10, lr=b["lr"],
                        kd=1.0, ce=1.0, temperature=1.0, text_share=0.0, lora_rank=b["lora_rank"], seed=seed,
                        autocast=native_bf16(teacher.device), checkpoint_every=10**9, eval_every=10**9)
    ckpt = cache_dir() / "distill" / f"specialist_{domain}.pt"
    ckpt.unlink(missing_ok=True)
    curve, hist, t_train = [], [], 0.0
    start = agreement(merged(student), tok, curve_set)  # the pruned start, before training
    curve.append({"step": 0, "heldout_answer_match": start["answer_match"], "heldout_top1": start["top1_agree"]})
    done = 0
    for stop in b["checkpoints"]:
        t0 = time.perf_counter()
        cfg.checkpoint_every = stop - done
        hist = distill_ability(student, teacher, train, torch.zeros(2, dtype=torch.long), cfg, tok.eos_id,
                               checkpoint=ckpt, stop_after=stop - done)
        t_train += time.perf_counter() - t0
        done = stop
        a = agreement(merged(student), tok, curve_set)
        curve.append({"step": stop, "train_s": t_train, "heldout_answer_match": a["answer_match"],
                      "heldout_top1": a["top1_agree"], "loss": hist[-1]["loss"]})
        print(f"step {stop}: held-out answer match {a['answer_match']:.2f} (on {len(curve_set)}), top-1 "
              f"{a['top1_agree']:.2f}, {t_train / 60:.1f} train-min", flush=True)
    ckpt.unlink(missing_ok=True)
    budget_out = {"steps": done, "train_s": t_train, "threads": torch.get_num_threads(),
                  "tokens": sum(h["tokens"] for h in hist), "loss_tokens": sum(h["loss_tokens"] for h in hist),
                  **{k: b[k] for k in ("batch_size", "lora_rank", "lr")}, "text_share": 0.0}
    sizes = {k: len(v) for k, v in parts.items()} | {"out_of_domain": len(sets["out_of_domain"]),
                                                      "in_domain_seen_measured": len(sets["in_domain_seen"]),
                                                      "in_domain_heldout_measured": len(held_rows)}
    templates, entities = held_out_parts(domain, seed=seed)
    split_info = {"domain": domain, "held_templates": [DOMAINS[domain]["templates"][i][1] for i in sorted(templates)],
                  "held_entities": sorted(entities), "sizes": sizes, "seed": seed}
    if ship:
        ship_student(student, dropped, {"command": "python -m minillm.recipes.specialist", "budget": budget_out,
                                        "split": split_info, "curve": curve}, name=NAME)
        specialist, _ = load_model(NAME, dtype="float32")  # what ships: the fp16 factors, rebuilt
    else:
        specialist = merged(student)
    Path(out).parent.mkdir(parents=True, exist_ok=True)  # what is known so far (the measurement below takes minutes)
    Path(out).write_text(json.dumps({"domain": domain, "budget": budget_out, "curve": curve, "split": split_info}))
    general, _ = load_model(GENERAL, dtype="float32")
    table = {}
    for name, model in (("specialist", specialist), ("general_student", general), ("teacher", teacher)):
        table[name] = {}
        for set_name, examples in sets.items():
            if name == "teacher":  # a check (its own answers: 1.0), on the first prompts of each set
                examples = examples[:b["teacher_measured"]]
            r = agreement(model, tok, examples)
            table[name][set_name] = {k: r[k] for k in ("answer_match", "top1_agree", "n")}
            if set_name == "in_domain_heldout" and name != "teacher":  # by why it is held out
                for k in ("held_template", "held_entity", "held_both"):
                    m = [x for x, (_, kind) in zip(r["matched"], held_rows) if kind == k]
                    table[name][set_name][f"answer_match_{k}"] = sum(m) / max(len(m), 1)
                    table[name][set_name][f"n_{k}"] = len(m)
            print(f"{name:16s} {set_name:18s} answer match {r['answer_match']:.3f}  top-1 {r['top1_agree']:.3f}",
                  flush=True)
    speed = decode_speed(specialist, teacher, chat_ids(tok, held_rows[0][0]), 32, b["decode_pairs"])
    print(f"decode: specialist {speed['specialist_tok_s']:.1f} tok/s, teacher {speed['teacher_tok_s']:.1f} tok/s "
          f"(x{speed['ratio_median']:.2f})", flush=True)
    result = {"domain": domain, "agreement": table, "decode": speed, "budget": budget_out, "curve": curve,
              "split": split_info, "recipe": NAME if ship else None,
              "notes": ["answer_match: greedy answer starts with the teacher's first sentence (exact tokens); "
                        "top1_agree: teacher-forced on the teacher's answers",
                        f"in_domain_heldout: {len(sets['in_domain_heldout'])} sampled domain prompts with a held-out "
                        "phrasing or a held-out country (or both); "
                        f"in_domain_seen: {len(sets['in_domain_seen'])} sampled training prompts; out_of_domain: "
                        "lesson 10/13's prompts + chat_data held-out prompts of other kinds",
                        f"curve: answer match on {len(curve_set)} of the held-out prompts, merged float32 LoRA"]}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["-h"], ["--help"]):
        print(__doc__)
        return
    run(*argv[:1])


if __name__ == "__main__":
    main()
