"""A specialist student (lessons 09 and 13): the general student's pruned start, distilled on ONE narrow job.

The general student matches the teacher's first sentence on ~12% of new chat prompts. Trained only on plurals and
opposites, the same 16-block start answers like the teacher on phrasings and words it never saw, at the student's
speed (lesson 13 routes the job to it). The countries domain is kept as the finding: facts the dropped blocks held.

    python -m minillm.recipes.specialist [countries]   # CPU minutes: -> minillm/assets/, results/specialist*.json
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch

from minillm.compress.chat_data import ALWAYS_HELD_OUT, COUNTRIES, NOUNS, chat_ids, chat_prompts, is_held_out

NAME = "smollm2-135m-specialist-words"
GENERAL = "smollm2-135m-student"
MORE_COUNTRIES = ["Bolivia", "Venezuela", "Ecuador", "Uruguay", "Paraguay", "Romania", "Bulgaria", "Serbia",
                  "Croatia", "the Netherlands", "Czechia", "Slovakia", "Lithuania", "Latvia", "Estonia",
                  "Saudi Arabia", "Jordan", "Syria", "Lebanon", "Afghanistan", "Bangladesh", "Sri Lanka",
                  "Malaysia", "the Philippines", "Singapore", "Cambodia", "Mongolia", "Kazakhstan", "Algeria",
                  "Tunisia", "Libya", "Sudan", "Tanzania", "Uganda", "Senegal", "Cameroon", "Zimbabwe", "Angola",
                  "Madagascar", "Haiti", "Panama", "Costa Rica", "Guatemala", "Honduras", "Qatar", "Belarus"]
PLURAL_NOUNS = NOUNS + [
    "dog", "cat", "church", "glass", "dish", "watch", "fox", "class", "party", "lady", "day", "boy", "key", "toy",
    "wife", "life", "loaf", "shelf", "half", "calf", "thief", "roof", "tomato", "echo", "piano", "photo", "radio",
    "man", "fungus", "crisis", "apple", "tree", "car", "book", "pen", "table", "chair", "horse", "bird", "flower",
    "house", "river", "island", "cloud", "star", "girl", "hand", "eye", "window", "door", "bottle", "brush",
    "bench", "wish", "tax", "fly", "berry", "cherry", "puppy", "army", "monkey", "valley", "journey", "hobby",
    "candle", "friend", "teacher", "doctor", "farmer", "king", "queen", "lion", "tiger", "goat", "ship", "boat",
    "train", "road", "bridge", "village", "garden", "forest", "mountain", "lake", "desk", "lamp", "clock", "cup",
    "plate", "spoon", "shoe", "hat", "coat", "dress", "match", "kiss", "body", "country", "family", "penny",
    "animal", "pencil", "computer", "phone", "letter", "garage", "kitchen", "bedroom", "student", "nurse",
    "singer", "painter", "soldier", "pilot", "banana", "orange", "lemon", "onion", "carrot", "egg", "cake",
    "cookie", "sandwich", "glove", "scarf", "boot", "ring", "wheel", "engine", "planet", "ocean", "beach",
    "desert", "storm", "butterfly", "rabbit", "turtle", "snake", "eagle", "basket", "blanket", "button"]
# an adjective and its opposite are one entity: holding out "hot" alone would still train "cold -> hot"
ANTONYM_PAIRS = [
    ("happy", "sad"), ("big", "small"), ("fast", "slow"), ("hot", "cold"), ("bright", "dark"), ("easy", "hard"),
    ("old", "young"), ("strong", "weak"), ("rich", "poor"), ("quiet", "loud"), ("clean", "dirty"),
    ("early", "late"), ("kind", "cruel"), ("brave", "cowardly"), ("calm", "angry"), ("tall", "short"),
    ("wide", "narrow"), ("heavy", "light"), ("wet", "dry"), ("full", "empty"), ("thick", "thin"), ("high", "low"),
    ("deep", "shallow"), ("soft", "rough"), ("sweet", "sour"), ("true", "false"), ("good", "bad"), ("new", "used"),
    ("cheap", "expensive"), ("safe", "dangerous"), ("near", "far"), ("right", "wrong"), ("polite", "rude"),
    ("alive", "dead"), ("awake", "asleep"), ("healthy", "sick"), ("simple", "complex"), ("beautiful", "ugly"),
    ("tidy", "messy"), ("sharp", "dull"), ("loose", "tight"), ("warm", "cool"), ("busy", "idle"),
    ("honest", "dishonest"), ("lazy", "hardworking"), ("generous", "selfish"), ("patient", "impatient"),
    ("careful", "careless"), ("modern", "ancient"), ("positive", "negative"), ("public", "private"),
    ("friendly", "hostile"), ("smart", "stupid"), ("funny", "serious"), ("happy-go-lucky", "gloomy"),
    ("open", "closed"), ("visible", "invisible"), ("strict", "lenient"), ("wild", "tame"), ("fresh", "stale")]
# (fact, phrasing): several phrasings per fact, so a phrasing held out of training asks a fact the student learned;
# a group's entities are asked with the group's phrasings. "words": phrasings the teacher answers in one form
# (probed on 24-30 words each: 96-100% one form; phrasings the teacher answers in two forms, such as "Give the
# plural of the word X." with and without quotes, are left out: no student can learn a coin toss).
DOMAINS: dict[str, list[dict]] = {
    "words": [
        {"entities": PLURAL_NOUNS, "templates": [
            ("plural", "What is the plural of {}?"), ("plural", "What is the plural form of {}?"),
            ("plural", "What is the correct plural of {}?"), ("plural", "What's the plural of {}?"),
            ("plural", "Tell me the plural of {}.")]},
        {"entities": ANTONYM_PAIRS, "templates": [
            ("opposite", "What is the opposite of {}?"), ("opposite", "What is the antonym of {}?"),
            ("opposite", "What word means the opposite of {}?"), ("opposite", "What is the opposite word of {}?"),
            ("opposite", "Tell me the opposite of {}."), ("opposite", "What's the opposite of {}?")]}],
    "countries": [  # kept as the finding: the teacher's country answers are facts it holds unevenly (10% held out)
        {"entities": COUNTRIES + MORE_COUNTRIES, "templates": [
            ("capital", "What is the capital of {}?"), ("capital", "Which city is the capital of {}?"),
            ("capital", "Name the capital city of {}."), ("language", "What language is spoken in {}?"),
            ("language", "What is the main language of {}?"), ("continent", "What continent is {} in?"),
            ("continent", "On which continent is {}?"), ("currency", "What currency is used in {}?"),
            ("currency", "What is the currency of {}?")]}],
}


def _groups(domain: str) -> list[dict]:
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}: the specialist knows {sorted(DOMAINS)}")
    return DOMAINS[domain]


def templates(domain: str = "words") -> list[tuple[str, str]]:
    """The domain's (fact, phrasing) in order: a template id indexes this list."""
    return [t for g in _groups(domain) for t in g["templates"]]


def _units(group: dict) -> list[tuple[str, ...]]:
    """A group's entities as units held out together (an antonym pair is one unit)."""
    return [e if isinstance(e, tuple) else (e,) for e in group["entities"]]


def domain_prompts(domain: str = "words") -> list[tuple[str, int, str]]:
    """Every (prompt, template id, entity) of `domain`, in a fixed order."""
    out, first = [], 0
    for g in _groups(domain):
        for unit in _units(g):
            out += [(t.format(e), first + i, e) for e in unit for i, (_, t) in enumerate(g["templates"])]
        first += len(g["templates"])
    return out


def held_out_parts(domain: str = "words", template_share: float = 0.25, entity_share: float = 0.25,
                   seed: int = 0) -> tuple[set[int], set[str]]:
    """(held-out template ids, held-out entities), drawn from `seed`. At most one phrasing per fact is held out (the
    skill, not an untaught fact, is measured); a share of each group's entities is held out (an antonym pair
    together); an entity that lessons 10/13 measure on is always held out (with its pair)."""
    for what, share in (("template_share", template_share), ("entity_share", entity_share)):
        if not 0 < share < 1:
            raise ValueError(f"{what} must be in (0, 1), got {share!r}")
    rng = random.Random(seed)
    facts: dict[str, list[int]] = {}
    for i, (fact, _) in enumerate(templates(domain)):
        facts.setdefault(fact, []).append(i)
    can = [rng.choice(ids) for ids in facts.values() if len(ids) > 1]
    n_t = max(1, min(len(can), round(template_share * len(templates(domain)))))
    held_templates = set(rng.sample(can, n_t))
    always = {e for p, _, e in domain_prompts(domain) if p in ALWAYS_HELD_OUT}
    entities: set[str] = set()
    for g in _groups(domain):
        units = _units(g)
        fixed = [u for u in units if set(u) & always]
        rest = [u for u in units if not set(u) & always]
        n_e = max(0, round(entity_share * len(units)) - len(fixed))
        entities |= {e for u in fixed + rng.sample(rest, n_e) for e in u}
    return held_templates, entities


def domain_split(domain: str = "words", template_share: float = 0.25, entity_share: float = 0.25,
                 seed: int = 0) -> dict[str, list[tuple[str, int, str]]]:
    """{"train", "held_template", "held_entity", "held_both"}: the domain's (prompt, template id, entity), split so
    that training sees no held-out phrasing and no held-out entity; the three held-out parts are in-domain held-out."""
    held_t, held_e = held_out_parts(domain, template_share, entity_share, seed)
    out: dict[str, list] = {"train": [], "held_template": [], "held_entity": [], "held_both": []}
    for row in domain_prompts(domain):
        key = {(False, False): "train", (True, False): "held_template", (False, True): "held_entity",
               (True, True): "held_both"}[(row[1] in held_t, row[2] in held_e)]
        out[key].append(row)
    return out


def out_of_domain(domain: str = "words", n: int = 64, seed: int = 0) -> list[str]:
    """Chat prompts of other kinds, held out of the general student's training too: every prompt lessons 10/13
    measure on, then a seeded sample of the rest of chat_data's held-out split (none of the domain's prompts)."""
    mine = {p for p, _, _ in domain_prompts(domain)}
    held = [p for p in chat_prompts() if is_held_out(p) and p not in mine]
    first = [p for p in held if p in ALWAYS_HELD_OUT]
    rest = [p for p in held if p not in ALWAYS_HELD_OUT]
    return (first + random.Random(seed).sample(rest, max(0, n - len(first))))[:max(n, len(first))]


# ----------------------------------------------------------------------------------------------- the recipe

# a laptop's CPU minutes: 200 steps of 8 short examples (~110k tokens through teacher and student, ~4 minutes on
# 2 cores: a first run to 480 steps overfit after ~100, held-out match 0.58 -> 0.42 on its curve prompts); the curve
# is measured at each checkpoint
BUDGET = {"steps": 200, "batch_size": 8, "seq_len": 96, "lora_rank": 16, "lr": 2e-3, "max_answer": 48,
          "checkpoints": [25, 50, 100, 150, 200], "curve_prompts": 48, "seen_measured": 48, "ood_measured": 48,
          "teacher_measured": 16, "heldout_measured": 192, "decode_pairs": 3}  # None: every held-out prompt


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


def answer_value(text: str) -> str | None:
    """What a words answer says, without its form: "The plural form of knife is knives." -> "knives" (the words
    after the last " is ", lower-cased, quotes and the full stop dropped); None without " is "."""
    head, sep, value = text.partition(". ")[0].rpartition(" is ")
    return value.strip(' ."\'').lower() or None if sep else None


def value_match(model, tok, examples: list) -> float:
    """The share of prompts whose greedy first sentence says the teacher's value (answer_value), in any form."""
    from minillm.compress.ability import first_sentence
    from minillm.engine.llm import LLM
    from minillm.sampling import SamplingParams

    outs = LLM.from_model(model, tok, max_num_seqs=32).generate([p for p, _ in examples], SamplingParams(max_tokens=40))
    said = [answer_value(tok.decode(first_sentence(o.token_ids, tok))) for o in outs]
    want = [answer_value(tok.decode(first_sentence(a, tok))) for _, a in examples]
    return sum(x is not None and x == y for x, y in zip(said, want)) / max(len(examples), 1)


def teacher_consistency(rows: list[tuple[str, int, str]], answers: dict, tok) -> float:
    """How often the teacher names, for a word, the value it names most often for that word across phrasings: a
    ceiling on any student that gives one answer per word (the teacher's own answers disagree with each other)."""
    from collections import Counter

    from minillm.compress.ability import first_sentence

    by: dict[str, list] = {}
    for p, _, e in rows:
        by.setdefault(e, []).append(answer_value(tok.decode(first_sentence(answers[p], tok))))
    return sum(Counter(v).most_common(1)[0][1] for v in by.values()) / max(sum(map(len, by.values())), 1)


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


def run(domain: str = "words", budget: dict | None = None, out: str | Path | None = None,
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
    name = NAME if domain == "words" else f"smollm2-135m-specialist-{domain}"  # the words specialist is shipped
    out = out or ("results/specialist.json" if domain == "words" else f"results/specialist-{domain}.json")
    torch.manual_seed(seed)
    teacher, tok = load_model("smollm2-135m", dtype="float32")
    parts = domain_split(domain, seed=seed)
    ood = out_of_domain(domain, b["ood_measured"], seed)
    prompts = [p for p, _, _ in domain_prompts(domain)]  # the cache's key: this order
    answers = dict(zip(prompts, teacher_answers(teacher, tok, prompts, b["max_answer"],
                                                cache=answers_path(f"specialist_{domain}_answers.json"))))
    answers.update(zip(ood, teacher_answers(teacher, tok, ood, 64, cache=answers_path("specialist_ood.json"))))
    ex = lambda ps: [(chat_ids(tok, p), answers[p]) for p in ps if answers[p]]
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
    held_t, entities = held_out_parts(domain, seed=seed)
    split_info = {"domain": domain, "held_templates": [templates(domain)[i][1] for i in sorted(held_t)],
                  "held_entities": sorted(entities), "sizes": sizes, "seed": seed}
    if ship:
        ship_student(student, dropped, {"command": "python -m minillm.recipes.specialist", "budget": budget_out,
                                        "split": split_info, "curve": curve}, name=name)
        specialist, _ = load_model(name, dtype="float32")  # what ships: the fp16 factors, rebuilt
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
                if domain == "words":  # form vs content: does it name the teacher's word, in any form?
                    table[name][set_name]["value_match"] = value_match(model, tok, examples)
            print(f"{name:16s} {set_name:18s} answer match {r['answer_match']:.3f}  top-1 {r['top1_agree']:.3f}",
                  flush=True)
    consistency = teacher_consistency(domain_prompts(domain), answers, tok) if domain == "words" else None
    speed = decode_speed(specialist, teacher, chat_ids(tok, held_rows[0][0]), 32, b["decode_pairs"])
    print(f"decode: specialist {speed['specialist_tok_s']:.1f} tok/s, teacher {speed['teacher_tok_s']:.1f} tok/s "
          f"(x{speed['ratio_median']:.2f})", flush=True)
    result = {"domain": domain, "agreement": table, "decode": speed, "teacher_consistency": consistency,
              "budget": budget_out, "curve": curve,
              "split": split_info, "recipe": name if ship else None,
              "notes": ["answer_match: greedy answer starts with the teacher's first sentence (exact tokens); "
                        "top1_agree: teacher-forced on the teacher's answers",
                        f"in_domain_heldout: {len(sets['in_domain_heldout'])} sampled domain prompts with a held-out "
                        "phrasing or a held-out country (or both); "
                        f"in_domain_seen: {len(sets['in_domain_seen'])} sampled training prompts; out_of_domain: "
                        "lesson 10/13's prompts + chat_data held-out prompts of other kinds",
                        f"curve: answer match on {len(curve_set)} of the held-out prompts, merged float32 LoRA",
                        "value_match: the greedy first sentence names the teacher's word (answer_value), in any form; "
                        "teacher_consistency: the share of the teacher's answers naming the word it names most often "
                        "for that word across phrasings (a ceiling for a student that gives one answer per word)"]}
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
