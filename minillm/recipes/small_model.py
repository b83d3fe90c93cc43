"""The small model's parts that need the batching engine (lessons 09, 10, 13): the teacher's answers to the chat
prompts, the student's retained ability measured on held-out ones, and the command that trains the learned drafter.

    python -m minillm.recipes.small_model drafter  # lesson 10's draft head: ~25 min on 2 CPU cores -> minillm/assets/
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


def teacher_answers(teacher, tokenizer, prompts: list[str], max_tokens: int = 64, cache: Path | None = None,
                    max_num_seqs: int = 32, progress: bool = True) -> list[list[int]]:
    """The teacher's greedy answer (token ids, its stop token included if reached) to each prompt, generated with
    the batching engine and cached as JSON keyed by the prompts and max_tokens (a changed set regenerates)."""
    from minillm.engine.llm import LLM
    from minillm.sampling import SamplingParams

    key = hashlib.sha256(json.dumps([prompts, max_tokens]).encode()).hexdigest()[:16]
    if cache is not None and Path(cache).exists():
        data = json.loads(Path(cache).read_text())
        if data.get("key") == key:
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
    if cache is not None:
        Path(cache).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(str(cache) + ".tmp")
        tmp.write_text(json.dumps({"key": key, "max_tokens": max_tokens, "prompts": prompts, "answers": answers}))
        os.replace(tmp, cache)
    return answers


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
                  weight_decay: float = 0.1, text_windows: int = 600, window: int = 256) -> None:
    """The shipped head's recipe (its .json records the result). The teacher's answers to the training prompts, plus
    `text_windows` pydoc windows labelled with the target's own choices; EAGLE's regularisers (feature noise, weight
    decay); early stopping on half of the held-out prompts, and the other half reported (neither is trained on)."""
    from minillm.api import load_model
    from minillm.compress.distill import train_ids
    from minillm.speculative.learned import ASSETS, DRAFTER, DraftHead, save_draft_head
    from minillm.speculative.train_drafter import (choose_vocab, concat, expected_tokens, guess_accuracy,
                                                   target_features, train_draft_head)

    torch.manual_seed(seed)
    target, tok = load_model("smollm2-135m", dtype="float32")
    prompts = chat_prompts()
    answers = dict(zip(prompts, teacher_answers(target, tok, prompts, cache=answers_path())))
    train, held = split(prompts)
    rng = random.Random(seed)

    def features(ps: list[str]) -> dict:  # guesses start at the last prompt token: the answers are what it drafts
        ids = [chat_ids(tok, p) for p in ps]
        return target_features(target, [i + answers[p] for i, p in zip(ids, ps)], first=[len(i) - 1 for i in ids])

    text = train_ids(tok)
    starts = sorted(rng.sample(range(0, len(text) - window, window), min(text_windows, (len(text) - 1) // window)))
    chat = features(train)
    data = concat(chat, target_features(target, [text[i:i + window].tolist() for i in starts])) if text_windows \
        else chat
    # early stopping never sees the prompts lessons 10 and 13 measure on: they stay in the reported half
    rest = [p for p in held if p not in ALWAYS_HELD_OUT]
    rest = rng.sample(rest, len(rest))
    measured = [p for p in held if p in ALWAYS_HELD_OUT]
    stop_on, report_on = features(rest[:len(rest) // 2]), features(rest[len(rest) // 2:] + measured)
    vocab, coverage = choose_vocab(chat["choice"], size, sorted(tok.stop_ids))
    head = DraftHead(target.config.dim, hidden, vocab).bind(target)
    hist = train_draft_head(head, data, steps=steps, seed=seed, noise=noise, weight_decay=weight_decay,
                            eval_data=stop_on)
    acc, acc_train = guess_accuracy(head, report_on), guess_accuracy(head, chat)
    print(f"vocabulary {size} tokens covers {coverage:.1%} of the target's choices in the answers; chained top-1 per "
          f"guess, held-out: {[round(a, 3) for a in acc]}, training answers: {[round(a, 3) for a in acc_train]}; "
          f"kept step {hist[-1]['best_step']} of {steps}")
    info = {"base": "smollm2-135m", "vocab_size": size, "hidden": hidden, "steps": steps, "seed": seed,
            "noise": noise, "weight_decay": weight_decay, "best_step": hist[-1]["best_step"],
            "train_prompts": len(train), "answer_tokens": int(chat["tokens"].numel()),
            "text_windows": len(starts) if text_windows else 0, "window": window,
            "train_tokens": int(data["tokens"].numel()), "vocab_coverage": coverage,
            "heldout_prompts": {"early_stopping": len(rest) // 2, "reported": len(held) - len(rest) // 2},
            "heldout_chained_top1": acc, "heldout_tokens_per_step": expected_tokens(acc),
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
