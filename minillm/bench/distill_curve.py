"""The general student past the ship (lesson 09): held-out answer match and top-1 against training tokens.

`minillm bench distill` ships the 16-block student after 300 steps (433k tokens, ~25 CPU-minutes), its held-out
answer match still rising. This continues from what shipped (fresh LoRA adapters on the shipped weights, the same
data and mix) and measures the same held-out prompts every `every` steps, so the curve shows what more tokens buy.

    nice python -m minillm.bench.distill_curve [steps] [every]   # -> results/distill-curve.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


def run(steps: int = 480, every: int = 120, out: str | Path = "results/distill-curve.json") -> dict:
    """Train the shipped student `steps` more steps of the bench's full budget; measure at 0 and every `every`."""
    if not (isinstance(steps, int) and isinstance(every, int) and 0 < every <= steps):
        raise ValueError(f"steps and every must be whole numbers with 0 < every <= steps, got {steps!r}, {every!r}")
    from minillm.api import load_model
    from minillm.bench.distill import budget, chat_data, merged
    from minillm.compress.ability import AbilityConfig, distill_ability
    from minillm.compress.distill import train_ids
    from minillm.compress.lora import add_lora
    from minillm.gguf.saved import recipe_path
    from minillm.gguf.weights import cache_dir
    from minillm.measure.hardware import native_bf16
    from minillm.recipes.small_model import retained_ability

    b = budget(quick=False)
    teacher, tok = load_model("smollm2-135m", dtype="float32")
    student, _ = load_model("smollm2-135m-student", dtype="float32")
    shipped = json.loads(Path(f"{recipe_path('smollm2-135m-student')}.json").read_text())["eval"]
    train, held, facts = chat_data(teacher, tok, b)
    text = train_ids(tok)
    add_lora(student, rank=b["lora_rank"], alpha=2.0 * b["lora_rank"])
    # the shipped run's schedule: warm-up, then the bench's learning rate, a quarter of steps plain-text KD
    cfg = AbilityConfig(steps=steps, batch_size=b["batch_size"], seq_len=b["seq_len"], warmup=10, lr=2e-3, kd=1.0,
                        ce=1.0, temperature=1.0, lora_rank=b["lora_rank"], seed=1,
                        autocast=native_bf16(teacher.device), checkpoint_every=every, eval_every=10**9)
    tokens, train_s = shipped["train_tokens"], shipped["train_s"]
    curve = []
    ckpt = cache_dir() / "distill" / "student_curve.pt"  # steps, adapters and optimizer: a later call resumes
    ckpt.unlink(missing_ok=True)

    def point(step: int) -> None:
        r = retained_ability(merged(student), tok, held)
        curve.append({"step": shipped["train_steps"] + step, "tokens": tokens, "train_s": train_s,
                      "answer_match": r["answer_match"], "top1": r["top1_agree"]})
        print(f"step {curve[-1]['step']}: {tokens:,} tokens, {train_s / 60:.1f} CPU-min: answer match "
              f"{r['answer_match']:.3f}, top-1 {r['top1_agree']:.3f}", flush=True)
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"shipped": {k: shipped[k] for k in ("train_steps", "train_tokens",
                                                                           "train_s", "answer_match",
                                                                           "answer_top1")},
                                         "curve": curve, "heldout": facts["heldout_measured"],
                                         "threads": torch.get_num_threads(), "budget": {
                                             k: b[k] for k in ("batch_size", "seq_len", "lora_rank")},
                                         "command": f"python -m minillm.bench.distill_curve {steps} {every}"},
                                        indent=1))

    point(0)
    done = 0
    while done < steps:
        t0 = time.perf_counter()
        hist = distill_ability(student, teacher, train, text, cfg, tok.eos_id, checkpoint=ckpt, stop_after=every,
                               progress=False)
        train_s += time.perf_counter() - t0
        tokens = shipped["train_tokens"] + sum(h["tokens"] for h in hist)  # the whole history, resumed each time
        done = hist[-1]["step"]
        point(done)
    ckpt.unlink(missing_ok=True)
    return {"curve": curve}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["-h"], ["--help"]):
        print(__doc__)
        return
    run(*(int(a) for a in argv[:2]))


if __name__ == "__main__":
    main()
