"""Speculative decoding (lesson 10): a cheap drafter guesses k tokens, the target checks all in one forward.

Decode is memory bound, so a forward over k + 1 tokens costs about one decode step; each accepted draft is a
step saved. The output is still the target's: greedy keeps drafts while they equal the target's argmax
(`verify_greedy`); sampling accepts d with probability min(1, p(d) / q(d)), else draws from max(0, p - q)
renormalized (`rejection_sample`, Chen et al. 2023; q is one-hot for n-gram drafts). `generate_speculative` is
the single-sequence loop behind `generate(..., speculative=...)`; the engine verifies in its packed forward
(engine/model_runner.py). Drafters: drafters.py; the knobs: `SpeculativeConfig`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from minillm.request import Request
from minillm.sampling import SamplingParams, argmax_rows, logits_to_probs, sample
from minillm.speculative.drafters import Drafter, ModelDrafter, NgramDrafter

METHODS = ("ngram", "draft", "early_exit", "learned")


@dataclass
class SpeculativeConfig:
    """method "ngram" (prompt lookup), "draft" (draft_model: a model or a load_model name, e.g. the distilled
    "smollm2-135m-student"), "early_exit" (the target's first exit_layer blocks) or "learned" (draft_head: a
    learned.DraftHead, or the name/path of a saved one; default the shipped head for SmolLM2-135M-Instruct).
    k: tokens proposed per step (at most, for "learned" with min_confidence > 0: the chain stops once the head's
    own estimate that it survives falls below min_confidence).
    max_batch: the engine speculates only while at most this many sequences decode: verification stops being nearly
    free once the batch alone makes the forward compute bound. `minillm bench speculative` measures the engine at
    batch 1/4/16; on a 2-core CPU prompt lookup on grounded requests still paid at 16 (README), so the default is
    16; lower it for workloads whose drafts are rarely accepted."""

    method: str = "ngram"
    k: int = 4
    draft_model: object = None
    draft_head: object = None
    exit_layer: int = 8
    ngram_max: int = 3
    ngram_min: int = 2
    max_batch: int = 16
    min_confidence: float = 0.0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; choose one of {METHODS}")
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise ValueError(f"k (draft tokens per step) must be an integer >= 1, got {self.k!r}")
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("method='draft' needs draft_model: a loaded model or a name, e.g. 'smollm2-135m-student'")
        if not isinstance(self.max_batch, int) or self.max_batch < 0:
            raise ValueError(f"max_batch must be an integer >= 0 (0: never speculate in the engine), got "
                             f"{self.max_batch!r}")


def make_drafter(config: SpeculativeConfig, target, num_blocks: int = 1024, block_size: int = 16) -> Drafter:
    """The drafter a config names, checked against the target (vocabulary, device)."""
    if config.method == "ngram":
        return NgramDrafter(config.ngram_max, config.ngram_min)
    if config.method == "early_exit":
        if not 1 <= config.exit_layer < len(target.layers):
            raise ValueError(f"exit_layer must be in 1..{len(target.layers) - 1} (the target has "
                             f"{len(target.layers)} blocks), got {config.exit_layer}")
        drafter = ModelDrafter(target, config.exit_layer, num_blocks, block_size)
    elif config.method == "learned":
        from minillm.speculative.learned import DRAFTER, LearnedDrafter, draft_head_for

        head = config.draft_head if isinstance(config.draft_head, torch.nn.Module) else draft_head_for(
            target, str(config.draft_head or DRAFTER))
        drafter = LearnedDrafter(target, head, config.min_confidence)
    else:
        draft = config.draft_model
        if isinstance(draft, str):
            from minillm.gguf.loader import load_from_file as load_model

            draft, _ = load_model(draft, dtype=str(target.dtype).removeprefix("torch."), device=str(target.device))
        drafter = ModelDrafter(draft, None, num_blocks, block_size)
    drafter.check_target(target)
    return drafter


@dataclass
class SpecStats:
    """Counts over verification steps.

    acceptance_rate is a, the chance that one draft token passes given the ones before it did: accepted /
    (accepted + rejections), counting only the drafts that were checked (everything after the first rejection is
    thrown away unchecked). It is comparable with a draft's top-1 agreement and is the `a` of the expected-tokens
    formula. accepted_fraction = accepted / proposed (what vLLM reports) also charges the unchecked drafts."""

    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    rejected: int = 0  # steps whose drafts were not all accepted
    emitted: int = 0

    def record(self, n_proposed: int, n_accepted: int, n_emitted: int) -> None:
        self.steps += 1
        self.proposed += n_proposed
        self.accepted += n_accepted
        self.rejected += n_accepted < n_proposed
        self.emitted += n_emitted

    @property
    def acceptance_rate(self) -> float:
        checked = self.accepted + self.rejected
        return self.accepted / checked if checked else float("nan")

    @property
    def accepted_fraction(self) -> float:
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.steps if self.steps else float("nan")


def expected_tokens_per_step(a: float, k: int) -> float:
    """Mean tokens a verification step yields when each draft is accepted independently with probability a."""
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def verify_greedy(target_argmax: list[int], draft: list[int]) -> list[int]:
    """target_argmax[i] is the target's choice after draft[:i] (len(draft) + 1 of them). Returns the accepted
    drafts followed by the target's own token: the first correction, or the bonus token when all pass."""
    n = 0
    while n < len(draft) and draft[n] == target_argmax[n]:
        n += 1
    return draft[:n] + [target_argmax[n]]


def rejection_sample(p: Tensor, q: Tensor | None, draft: list[int],
                     generator: torch.Generator | None = None) -> list[int]:
    """The exact rule. p (k + 1, vocab): the target's distributions at the k draft positions and after them;
    q (k, vocab): the drafter's distributions the drafts were drawn from, or None for one-hot guesses.
    Returns the accepted drafts and one token from the target (residual draw, or bonus)."""
    k = len(draft)
    if p.shape[0] != k + 1 or (q is not None and q.shape[0] != k):
        raise ValueError(f"{k} drafts need p of {k + 1} rows and q of {k}, got {tuple(p.shape)}, "
                         f"{None if q is None else tuple(q.shape)}")
    rows, tokens = torch.arange(k, device=p.device), torch.tensor(draft, dtype=torch.long, device=p.device)
    p_x = p[rows, tokens]
    q_x = q[rows, tokens] if q is not None else torch.ones_like(p_x)
    u = torch.rand(k, generator=generator, device=p.device)
    accepted = (u * q_x < p_x).tolist()  # u < p/q without dividing by a zero q
    n = accepted.index(False) if False in accepted else k
    if n == k:
        return draft + [int(sample(p[k:k + 1], generator)[0])]
    if q is not None:
        residual = (p[n] - q[n]).clamp_min(0)
    else:
        residual = p[n].clone()
        residual[draft[n]] = 0
    if float(residual.sum()) <= 0:  # p == q up to rounding: no mass left to correct, p itself is the answer
        residual = p[n]
    return draft[:n] + [int(sample((residual / residual.sum())[None], generator)[0])]


def verify(logits: Tensor, draft: list[int], q: Tensor | None, params: SamplingParams,
           generator: torch.Generator | None = None) -> list[int]:
    """logits (k + 1, vocab): the target's raw logits at the last token and at each draft -> the emitted tokens."""
    if params.temperature == 0:
        return verify_greedy(argmax_rows(logits).tolist(), draft)
    p = logits_to_probs(logits, params.temperature, params.top_k, params.top_p)
    return rejection_sample(p, q, draft, generator)


def check_budget(k: int, prompt_len: int, max_seq_len: int) -> None:
    if k >= max_seq_len - prompt_len:
        raise ValueError(f"k={k} draft tokens do not fit after a {prompt_len}-token prompt in a {max_seq_len}-token "
                         f"context: lower k")


@torch.inference_mode()
def generate_speculative(model, req: Request, drafter: Drafter, k: int, kv,
                         stats: SpecStats | None = None) -> Iterator[int]:
    """Yield the new token ids of one request, several per target forward, over `kv` (an empty cache with room for
    prompt + max_tokens + k): the same tokens as target-only greedy decoding, the target's distribution when
    sampling."""
    if kv is None:
        raise ValueError("speculative decoding verifies drafts over a KV cache: use cache='contiguous' or 'paged'")
    params, ids = req.params, list(req.prompt_ids)
    max_len = model.config.max_seq_len
    check_budget(k, len(ids), max_len)
    # after each target forward the drafter is told which logits rows are whose (as in LLM.step)
    logits = model(torch.tensor([ids], device=model.device), kv_cache=kv, last_only=True)[0]  # prefill
    drafter.observe([(req.request_id, len(ids) - 1, 1)])
    new = verify(logits, [], None, params, req.generator)  # no drafts yet: one ordinary sample
    n_out = 0
    while True:
        for tok in new:
            yield tok
            ids.append(tok)
            n_out += 1
            if tok in req.stop_ids or n_out == params.max_tokens:
                return
        # cached: ids[:-1]; the last token and up to n drafts go through the target next
        n = min(k, params.max_tokens - n_out - 1, max_len - len(ids))
        draft, q = drafter.propose([(req.request_id, ids, n)], [params], [req.generator])[0] if n > 0 else ([], None)
        cached = len(ids) - 1
        logits = model(torch.tensor([ids[-1:] + draft], device=model.device), kv_cache=kv)[0]
        drafter.observe([(req.request_id, cached, 1 + len(draft))])
        new = verify(logits, draft, q, params, req.generator)
        kv.truncate(cached + len(new))  # keep the last token + the accepted drafts; the rejected ones vanish
        if stats is not None:
            stats.record(len(draft), len(new) - 1, len(new))


__all__ = ["METHODS", "SpecStats", "SpeculativeConfig", "check_budget", "expected_tokens_per_step",
           "generate_speculative", "make_drafter", "rejection_sample", "verify", "verify_greedy"]
