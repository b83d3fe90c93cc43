"""Did a transformation hurt the model? Perplexity on real text, and KL divergence to the original model.

The text is `pydoc_data.topics`, English that ships with Python (no download): `eval_ids` takes its head,
`calibration_ids` its tail, held apart. `perplexity` is exp(mean next-token NLL): absolute but coarse.
`kl_to_reference` is the mean KL(reference || model) per position: 0 means unchanged, and it catches small
damage that perplexity hides. Used by lesson 02 (MQA's cost) and every later lesson that changes weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def pydoc_text() -> str:
    """~465 KB of CPython's own documentation topics, in a fixed (sorted) order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def eval_ids(tokenizer, max_tokens: int, text: str | None = None) -> list[int]:
    """The first `max_tokens` token ids of `text` (default: pydoc_text())."""
    ids = tokenizer.encode(text if text is not None else pydoc_text())
    if len(ids) < 2:
        raise ValueError("the evaluation text needs at least 2 tokens")
    return ids[:max_tokens]


def calibration_ids(tokenizer, max_tokens: int) -> list[int]:
    """`max_tokens` token ids from the *end* of pydoc_text(): calibration data (AWQ, lesson 07) held apart from the
    evaluation text, which eval_ids takes from the start (the text is ~100k tokens long)."""
    ids = tokenizer.encode(pydoc_text()[-8 * max_tokens - 64:])
    return ids[-max_tokens:]


def _windows(ids: list[int], window: int) -> list[list[int]]:
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens (one to predict from, one to predict), got {window}")
    chunks = [ids[i:i + window] for i in range(0, len(ids), window)]
    return [c for c in chunks if len(c) >= 2]


@torch.inference_mode()
def perplexity_of_ids(model, ids: list[int], window: int = 512) -> float:
    """exp(mean NLL) of predicting ids[t+1] from ids[:t+1], in independent windows of `window` tokens."""
    nll, count = 0.0, 0
    for chunk in _windows(list(ids), window):
        x = torch.tensor([chunk], device=model.device)
        logits = model(x)[0, :-1].float()  # (len - 1, vocab): position t predicts token t + 1
        nll += F.cross_entropy(logits, x[0, 1:], reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(nll / count)


def perplexity(model, tokenizer, text: str | None = None, max_tokens: int = 2048, window: int = 512) -> float:
    """Perplexity of `model` on the first `max_tokens` tokens of `text` (default: the pydoc topics), scored in
    non-overlapping windows of `window` tokens (each window starts from scratch: a slightly pessimistic number)."""
    return perplexity_of_ids(model, eval_ids(tokenizer, max_tokens, text), window)


def kl_divergence(ref_logits: Tensor, logits: Tensor) -> Tensor:
    """KL(p_ref || p) per position, in nats: (..., vocab) -> (...)."""
    ref_logp = F.log_softmax(ref_logits.float(), dim=-1)
    logp = F.log_softmax(logits.float(), dim=-1)
    return (ref_logp.exp() * (ref_logp - logp)).sum(dim=-1)


@torch.inference_mode()
def kl_to_reference(model, ref_model, ids: list[int] | Tensor, window: int = 512) -> float:
    """Mean KL(ref_model || model) of the next-token distributions over every position of `ids` (nats/token)."""
    ids = ids.flatten().tolist() if isinstance(ids, Tensor) else list(ids)
    total, count = 0.0, 0
    for chunk in _windows(ids, window):
        x = torch.tensor([chunk], device=model.device)
        kl = kl_divergence(ref_model(x)[0], model(x)[0])  # (len,)
        total += kl.sum().item()
        count += kl.numel()
    return total / count
