"""Train lesson 10's learned drafter (learned.py's DraftHead) on the teacher's own answers.

    python -m minillm.recipes.small_model drafter   # ~1 h on 2 AVX2 cores (half of it cached after); minillm/assets/

The target runs once over every training sequence (its features and greedy choices); the head learns to predict
the next feature and choice, unrolled on its own predictions as it drafts, with EAGLE's regularisers against
memorising a small data set (train_draft_head says which).
"""

from __future__ import annotations

import copy
import math
import sys
import time
from collections import Counter

import torch
import torch.nn.functional as F
from torch import Tensor

from minillm.speculative.learned import DraftHead


@torch.inference_mode()
def target_features(target, sequences: list[list[int]], autocast: bool = True, first: list[int] | None = None,
                    batch: int = 16) -> dict[str, Tensor]:
    """Concatenated over sequences: tokens, features (bf16), the target's argmax after each position, sequence id,
    and `use`: the positions a guess may start from (from first[i] on: e.g. the last prompt token, so the shared
    chat template is not learned 2,000 times over). Batches of similar lengths, right-padded (causal attention never
    looks right); `autocast` runs a bf16 copy of the target (twice the matmul rate where bf16 is native)."""
    model = copy.deepcopy(target).to(torch.bfloat16) if autocast else target
    out: list = [None] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    for start in range(0, len(order), batch):
        idx = order[start:start + batch]
        length = max(len(sequences[i]) for i in idx)
        x = torch.zeros(len(idx), length, dtype=torch.long, device=target.device)
        for row, i in enumerate(idx):
            x[row, :len(sequences[i])] = torch.tensor(sequences[i])
        h = model.run_layers(model.embed_tokens(x), torch.arange(length, device=x.device).expand_as(x))
        f = model.norm(h)
        choice = model.lm_head(f).argmax(-1)
        for row, i in enumerate(idx):
            n = len(sequences[i])
            out[i] = (x[row, :n].cpu(), f[row, :n].to(torch.bfloat16).cpu(), choice[row, :n].cpu())
        print(f"\rtarget features: {start + len(idx)}/{len(sequences)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    seq = [torch.full((len(s),), i) for i, s in enumerate(sequences)]
    use = [torch.arange(len(s)) >= (first[i] if first is not None else 0) for i, s in enumerate(sequences)]
    return {"tokens": torch.cat([o[0] for o in out]), "features": torch.cat([o[1] for o in out]),
            "choice": torch.cat([o[2] for o in out]), "seq": torch.cat(seq), "use": torch.cat(use)}


def concat(*parts: dict[str, Tensor]) -> dict[str, Tensor]:
    """One dataset from several target_features outputs (sequence ids renumbered so none run into another)."""
    out, offset = {k: [] for k in parts[0]}, 0
    for part in parts:
        for k, v in part.items():
            out[k].append(v + offset if k == "seq" else v)
        offset += int(part["seq"].max()) + 1 if part["seq"].numel() else 0
    return {k: torch.cat(v) for k, v in out.items()}


def choose_vocab(choice: Tensor, size: int, always: list[int]) -> tuple[Tensor, float]:
    """The `size` tokens the target chooses most often (and `always`, e.g. the stop tokens); their coverage."""
    counts = Counter(choice.tolist())
    ids = list(always)
    ids += [t for t, _ in counts.most_common() if t not in set(ids)][:size - len(ids)]
    covered = sum(counts[t] for t in ids) / sum(counts.values())
    return torch.tensor(sorted(ids)), covered


def valid_starts(data: dict[str, Tensor], unroll: int) -> Tensor:
    """Positions t whose next unroll + 1 tokens are in the same sequence, and that may start a guess."""
    seq = data["seq"]
    return torch.nonzero((seq[:-unroll - 1] == seq[unroll + 1:]) & data["use"][:-unroll - 1]).flatten()


def expected_tokens(accuracy: list[float]) -> float:
    """Tokens one verify step keeps with these chained top-1 accuracies (greedy): the bonus token + each guess that
    survives. The quantity speculative decoding's speedup scales with (lesson 10)."""
    return 1.0 + sum(accuracy)


def train_draft_head(head: DraftHead, data: dict[str, Tensor], steps: int = 600, batch: int = 1024, unroll: int = 3,
                     lr: float = 2e-3, seed: int = 0, autocast: bool = True, noise: float = 0.0,
                     weight_decay: float = 0.0, eval_data: dict[str, Tensor] | None = None,
                     eval_every: int = 50) -> list[dict]:
    """AdamW with warm-up and cosine decay over random start positions whose next `unroll` tokens share a sequence.
    With `eval_data`, every `eval_every` steps scores held-out features and keeps the best head (early stopping).

    Data: the training split of chat_data's prompts with the teacher's greedy answers (the held-out prompts never
    enter). Per position t the target gives its feature f_t (the output of its final norm) and its choice a_t (the
    argmax of its logits); the head learns, from (f_t, x_{t+1}), to predict f_{t+1} (smooth-L1) and a_{t+1}
    (cross-entropy over its vocabulary), unrolled `unroll` steps on its *own* predicted features, so the second and
    third guesses are trained on the errors the first one makes. A 3.3M-weight head memorises ~100k answer tokens
    (first recipe: chained top-1 0.85 on its training answers, 0.54 on held-out ones), hence EAGLE's regularisers:
    noise on the input features (`noise`, relative to their RMS), weight decay, more and plainer data (pydoc windows
    labelled with the target's own choices: `concat`), and early stopping on held-out features, scored as the tokens
    a verify step would keep (`expected_tokens`)."""
    tokens, feats, choice = data["tokens"], data["features"], data["choice"]
    index = torch.full((head.embed.shape[0],), -100, dtype=torch.long)
    index[head.vocab_ids] = torch.arange(head.vocab_ids.numel())
    starts = valid_starts(data, unroll)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    gen, history, t0 = torch.Generator().manual_seed(seed), [], time.perf_counter()
    best: tuple[float, int, dict] | None = None
    head.train()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        t = starts[torch.randint(len(starts), (batch,), generator=gen)]
        f = feats[t].float()
        if noise:  # the head drafts from features it never saw: make it robust to nearby ones
            rms = f.pow(2).mean(-1, keepdim=True).sqrt()
            f = f + noise * rms * (2 * torch.rand(f.shape, generator=gen) - 1)
        loss = 0.0
        correct = []
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            for j in range(unroll):
                f, logits = head(f, tokens[t + 1 + j])
                label = index[choice[t + 1 + j]]
                loss = loss + F.cross_entropy(logits.float(), label, ignore_index=-100) \
                    + F.smooth_l1_loss(f.float(), feats[t + 1 + j].float())
                correct.append((logits.argmax(-1) == label).float().mean().item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        history.append({"step": step + 1, "loss": loss.item(), **{f"acc{j + 1}": c for j, c in enumerate(correct)}})
        if eval_data is not None and ((step + 1) % eval_every == 0 or step + 1 == steps):
            head.eval()
            score = expected_tokens(guess_accuracy(head, eval_data, unroll))
            head.train()
            history[-1]["eval_tokens_per_step"] = score
            if best is None or score > best[0]:
                best = (score, step + 1, copy.deepcopy(head.state_dict()))
        if step % 10 == 0 or step + 1 == steps:
            eta = (time.perf_counter() - t0) / (step + 1) * (steps - step - 1)
            accs = " ".join(f"{c:.2f}" for c in correct)
            print(f"\rdraft head step {step + 1}/{steps}  loss {loss.item():.3f}  top-1 per guess {accs}  "
                  f"eta {eta / 60:.1f} min", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    if best is not None:
        head.load_state_dict(best[2])
        history.append({"best_step": best[1], "eval_tokens_per_step": best[0]})
    head.eval()
    return history


@torch.no_grad()
def guess_accuracy(head: DraftHead, data: dict[str, Tensor], unroll: int = 3, n: int = 4096, seed: int = 1) -> list:
    """Chained top-1 accuracy of guess 1..unroll against the target's choices (each guess given the previous)."""
    tokens, feats, choice = data["tokens"], data["features"], data["choice"]
    starts = valid_starts(data, unroll)
    t = starts[torch.randperm(len(starts), generator=torch.Generator().manual_seed(seed))[:n]]
    f, tok, alive, out = feats[t].float(), tokens[t + 1], torch.ones(len(t), dtype=torch.bool), []
    for j in range(unroll):
        f, logits = head(f, tok)
        guess = head.vocab_ids[logits.argmax(-1)]
        alive &= guess == choice[t + 1 + j]
        out.append(alive.float().mean().item())
        tok = guess
    return out
