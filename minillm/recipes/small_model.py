"""The small model's parts that need the batching engine (lessons 09, 10, 13): the teacher's answers to the chat
prompts (and to open ones it writes itself), the student's retained ability on held-out ones, the drafter's recipe.

    python -m minillm.recipes.small_model drafter  # lesson 10's draft head: ~1 h on 2 CPU cores -> minillm/assets/
    minillm bench distill                          # lesson 09's student: the sweep, then recipes/student.py ships it

Both read the same cached answers (answers_path()): the teacher answers every prompt of compress/chat_data.py once.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from pathlib import Path

import torch

from minillm.compress.ability import Example, first_sentence, top1_agreement
from minillm.compress.chat_data import ALWAYS_HELD_OUT, chat_ids, chat_prompts, split
from minillm.gguf.weights import cache_dir


def answers_path(name: str = "teacher_answers.json"):
    """Where the teacher's answers are cached ($MINILLM_CACHE or ~/.cache/minillm, under distill/)."""
    return cache_dir() / "distill" / name


def _key(*inputs) -> str:
    """What a cached generation was made from (a changed input set regenerates)."""
    return hashlib.sha256(json.dumps(inputs).encode()).hexdigest()[:16]


def _read_cache(cache: Path | None, key: str) -> dict | None:
    if cache is None or not Path(cache).exists():
        return None
    data = json.loads(Path(cache).read_text())
    return data if data.get("key") == key else None


def _write_cache(cache: Path | None, data: dict) -> None:
    """Written whole, then renamed: an interrupted run leaves the old file, never half of a new one."""
    if cache is None:
        return
    Path(cache).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(str(cache) + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, cache)


def teacher_answers(teacher, tokenizer, prompts: list[str], max_tokens: int = 64, cache: Path | None = None,
                    max_num_seqs: int = 32, progress: bool = True) -> list[list[int]]:
    """The teacher's greedy answer (token ids, its stop token included if reached) to each prompt, generated with
    the batching engine and cached as JSON keyed by the prompts and max_tokens (a changed set regenerates)."""
    from minillm.engine.llm import LLM
    from minillm.sampling import SamplingParams

    key = _key(prompts, max_tokens)
    if (data := _read_cache(cache, key)) is not None:
        return data["answers"]
    llm = LLM.from_model(teacher, tokenizer, max_num_seqs=max_num_seqs)
    answers: list[list[int]] = []
    chunk = 256
    for i in range(0, len(prompts), chunk):
        batch = [chat_ids(tokenizer, p) for p in prompts[i:i + chunk]]
        outs = llm.generate(batch, SamplingParams(max_tokens=max_tokens))
        answers += [o.token_ids for o in outs]
        if progress:
            print(f"\rteacher answers: {len(answers)}/{len(prompts)}", end="", flush=True)
    if progress:
        print()
    _write_cache(cache, {"key": key, "max_tokens": max_tokens, "prompts": prompts, "answers": answers})
    return answers


def open_prompts(model, tokenizer, n: int, seed: int = 0, max_tokens: int = 48, cache: Path | None = None,
                 max_num_seqs: int = 32, progress: bool = True) -> list[str]:
    """n open-chat prompts written by the instruct model itself (Magpie, Xu et al. 2024): its chat template up to
    an empty user turn, sampled (temperature 1, top-p 0.95, request i seeded seed + i), kept when the model closes
    the turn within max_tokens and the text is 3+ words of printable ASCII; de-duplicated, never one a lesson
    measures on. The templated prompts are narrow (facts, words, sums); real chat is not, and neither is this."""
    from minillm.engine.llm import LLM
    from minillm.sampling import SamplingParams

    key = _key(n, seed, max_tokens)
    if (data := _read_cache(cache, key)) is not None:
        return data["prompts"]
    text = tokenizer.decode(chat_ids(tokenizer, "x"))
    user = "<|im_start|>user\n"
    ids = tokenizer.encode(text[:text.index(user) + len(user)], allow_special=True)
    end = tokenizer.special_tokens["<|im_end|>"]
    llm = LLM.from_model(model, tokenizer, max_num_seqs=max_num_seqs)
    prompts, seen, i = [], set(ALWAYS_HELD_OUT), 0
    while len(prompts) < n:
        params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.95, seed=seed + i + j)
                  for j in range(256)]
        i += len(params)
        for o in llm.generate([ids] * len(params), params):
            if not o.token_ids or o.token_ids[-1] != end:
                continue  # the model never closed its turn: a fragment, not a question
            q = tokenizer.decode(o.token_ids[:-1]).strip()
            if len(q.split()) >= 3 and q.isascii() and q.isprintable() and q not in seen:
                seen.add(q)
                prompts.append(q)
        if progress:
            print(f"\ropen prompts: {min(len(prompts), n)}/{n} kept of {i} sampled", end="", file=sys.stderr,
                  flush=True)
    if progress:
        print(file=sys.stderr)
    prompts = prompts[:n]
    _write_cache(cache, {"key": key, "sampled": i, "prompts": prompts})
    return prompts


def retained_ability(student, tokenizer, examples: list[Example], max_tokens: int = 40) -> dict:
    """On held-out (prompt, teacher answer) pairs: the share whose student greedy answer starts with the teacher's
    first sentence (exact tokens), and top-1 agreement on the teacher's answers."""
    from minillm.engine.llm import LLM
    from minillm.sampling import SamplingParams

    targets = [first_sentence(a, tokenizer) for _, a in examples]
    llm = LLM.from_model(student, tokenizer, max_num_seqs=32)
    outs = llm.generate([p for p, _ in examples], [SamplingParams(max_tokens=min(max_tokens, max(len(t), 1)))
                                                   for t in targets])
    same = [o.token_ids[:len(t)] == t for o, t in zip(outs, targets)]
    return {"answer_match": sum(same) / len(same), "top1_agree": top1_agreement(student, examples),
            "n_prompts": len(examples), "matched": same}


def train_drafter(size: int = 4096, hidden: int = 1536, steps: int = 800, seed: int = 0, noise: float = 0.2,
                  weight_decay: float = 0.1, text_windows: int = 600, window: int = 256, open_chat: int = 1600) -> None:
    """The shipped head's recipe (its .json records the result). The teacher's answers to the training prompts (the
    templated ones and `open_chat` it wrote itself: open_prompts), plus `text_windows` pydoc windows labelled with
    the target's own choices; EAGLE's regularisers (feature noise, weight decay); early stopping on half of the
    held-out prompts, and the other half reported per kind (neither half is trained on)."""
    from minillm.api import load_model
    from minillm.compress.distill import train_ids
    from minillm.speculative.learned import ASSETS, DRAFTER, DraftHead, load_draft_head, save_draft_head
    from minillm.measure.hardware import native_bf16
    from minillm.speculative.train_drafter import (choose_vocab, concat, expected_tokens, guess_accuracy,
                                                   target_features, train_draft_head)

    torch.manual_seed(seed)
    target, tok = load_model("smollm2-135m", dtype="float32")
    bf16 = native_bf16(target.device)  # a bf16 copy of the target and bf16 autocast only where bf16 is native
    prompts = chat_prompts()
    answers = dict(zip(prompts, teacher_answers(target, tok, prompts, cache=answers_path())))
    written = open_prompts(target, tok, open_chat, seed=seed, cache=answers_path("open_prompts.json")) \
        if open_chat else []
    answers.update(zip(written, teacher_answers(target, tok, written, cache=answers_path("teacher_answers_open.json"))))
    train, held = split(prompts)
    open_train, open_held = split(written)
    train += open_train
    rng = random.Random(seed)

    def features(ps: list[str]) -> dict:  # guesses start at the last prompt token: the answers are what it drafts
        ids = [chat_ids(tok, p) for p in ps]
        return target_features(target, [i + answers[p] for i, p in zip(ids, ps)], first=[len(i) - 1 for i in ids],
                               autocast=bf16)

    text = train_ids(tok)
    starts = sorted(rng.sample(range(0, len(text) - window, window), min(text_windows, (len(text) - 1) // window)))
    chat = features(train)
    data = concat(chat, target_features(target, [text[i:i + window].tolist() for i in starts], autocast=bf16)) \
        if text_windows else chat
    # early stopping never sees the prompts lessons 10 and 13 measure on: they stay in the reported half
    rest = [p for p in held if p not in ALWAYS_HELD_OUT]
    rest, open_held = rng.sample(rest, len(rest)), rng.sample(open_held, len(open_held))
    measured = [p for p in held if p in ALWAYS_HELD_OUT]
    stop_on = features(rest[:len(rest) // 2] + open_held[:len(open_held) // 2])
    report_on = features(rest[len(rest) // 2:] + measured)
    report_open = features(open_held[len(open_held) // 2:]) if len(open_held) > 1 else None
    vocab, coverage = choose_vocab(chat["choice"], size, sorted(tok.stop_ids))
    previous = None  # the head this run replaces, scored on the same held-out halves: the recipe's prev vs next
    if (ASSETS / f"{DRAFTER}.pt").exists():
        old = load_draft_head(DRAFTER).bind(target)
        previous = {"sha256": old.info.get("sha256"), "heldout_chained_top1": guess_accuracy(old, report_on),
                    "heldout_open_chained_top1": guess_accuracy(old, report_open) if report_open is not None else None,
                    "train_prompts": old.info.get("train_prompts"), "steps": old.info.get("steps")}
    head = DraftHead(target.config.dim, hidden, vocab).bind(target)
    hist = train_draft_head(head, data, steps=steps, seed=seed, noise=noise, weight_decay=weight_decay,
                            eval_data=stop_on, autocast=bf16)
    acc, acc_train = guess_accuracy(head, report_on), guess_accuracy(head, chat)
    acc_open = guess_accuracy(head, report_open) if report_open is not None else None
    print(f"vocabulary {size} tokens covers {coverage:.1%} of the target's choices in the answers; chained top-1 per "
          f"guess, held-out templated: {[round(a, 3) for a in acc]}, held-out open: "
          f"{acc_open and [round(a, 3) for a in acc_open]}, training answers: {[round(a, 3) for a in acc_train]}; "
          f"kept step {hist[-1]['best_step']} of {steps}")
    info = {"base": "smollm2-135m", "vocab_size": size, "hidden": hidden, "steps": steps, "seed": seed,
            "noise": noise, "weight_decay": weight_decay, "best_step": hist[-1]["best_step"],
            "train_prompts": len(train), "open_prompts": {"written": len(written), "train": len(open_train)},
            "answer_tokens": int(chat["tokens"].numel()),
            "text_windows": len(starts) if text_windows else 0, "window": window,
            "train_tokens": int(data["tokens"].numel()), "vocab_coverage": coverage,
            "heldout_prompts": {"early_stopping": len(rest) // 2 + len(open_held) // 2,
                                "reported": len(held) - len(rest) // 2,
                                "reported_open": len(open_held) - len(open_held) // 2},
            "heldout_chained_top1": acc, "heldout_tokens_per_step": expected_tokens(acc),
            "heldout_open_chained_top1": acc_open,
            "heldout_open_tokens_per_step": acc_open and expected_tokens(acc_open), "previous_head": previous,
            "train_chained_top1": acc_train, "final_loss": next(h["loss"] for h in reversed(hist) if "loss" in h),
            "command": "python -m minillm.recipes.small_model drafter"}
    digest = save_draft_head(head, ASSETS / f"{DRAFTER}.pt", info)
    print(f"saved {ASSETS / f'{DRAFTER}.pt'} (sha256 {digest[:12]}...)")


USAGE = "usage: python -m minillm.recipes.small_model drafter   (the student: minillm bench distill)"

if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):
        print(USAGE)
    elif sys.argv[1:] != ["drafter"]:
        sys.exit(USAGE)
    else:
        train_drafter()
