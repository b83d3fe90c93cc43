"""Where speculative decoding's guesses come from (lesson 10): every drafter is a `Drafter`, one interface.

  NgramDrafter  prompt lookup: what followed the latest earlier occurrence of the last n tokens (no model);
  ModelDrafter  a small model decoding k tokens ahead (lesson 09's distilled student, or early_exit_model:
                the target's first n blocks + head), on its own paged cache, cut back to what was accepted.
  (LearnedDrafter, learned.py: a head that drafts from the target's own features.)
A cheap guess saves a target step when accepted, so the engine asks all of them the same way, in one batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
from torch import Tensor

from minillm.cache.block_allocator import BlockTable, OutOfBlocksError
from minillm.cache.paged import Chunk, PackedForward, PagedKVCache
from minillm.gguf.saved import empty_model
from minillm.gguf.vocabulary import check_same_vocabulary
from minillm.model import Transformer
from minillm.sampling import SamplingParams, logits_to_probs, sample

Proposal = tuple[list[int], Tensor | None]  # (draft ids, q: (len(draft ids), vocab), or None for one-hot guesses)


class Drafter(ABC):
    """What the engine (LLM.step) and generate_speculative call on every drafter, unconditionally.

        drafter.propose([("req-0", ids, 4)], [params], [generator]) -> [(draft_ids, q)]
    q (len(draft_ids), vocab): the distribution each draft was drawn from, or None (a one-hot guess).
    After each target forward the caller passes observe() which logits row is whose; a drafter that reads the
    target's features (wants_features: the learned one) keeps them, the others ignore it."""

    wants_features: bool = False

    @abstractmethod
    def propose(self, batch: list[tuple[str, list[int], int]], params: list[SamplingParams],
                generators: list) -> list[Proposal]:
        """Up to k drafts for each (key, token ids so far, k), with the distributions they were drawn from."""

    def observe(self, rows: list[tuple[str, int, int]]) -> None:
        """rows: (key, position of its first logits row, number of rows), in the last target forward's row order."""

    def release(self, key: str) -> None:
        """The sequence `key` ended: drop what is kept for it."""

    def check_target(self, target) -> None:
        """Refuse a target this drafter cannot draft for (raises ValueError)."""


def propose_ngram(ids: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to k tokens that continue `ids`, found in `ids` itself: take its last n tokens (n from max_n down to
    min_n: a longer match is better evidence), find their most recent earlier occurrence that has a token after it,
    and return the (at most k) tokens that followed it. [] when no suffix of length >= min_n occurred before."""
    last = ids[-1] if ids else None
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        pattern = ids[-n:]
        for i in range(len(ids) - n - 1, -1, -1):  # most recent first; the occurrence at the very end is excluded
            if ids[i + n - 1] == last and ids[i:i + n] == pattern:
                return ids[i + n:i + n + k]
    return []


class NgramDrafter(Drafter):
    """Prompt lookup decoding (propose_ngram): no model, no state."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not isinstance(max_n, int) or not isinstance(min_n, int) or not 1 <= min_n <= max_n:
            raise ValueError(f"need integers 1 <= min_n <= max_n, got min_n={min_n!r}, max_n={max_n!r}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, batch: list[tuple[str, list[int], int]], params: list[SamplingParams] | None = None,
                generators: list | None = None) -> list[Proposal]:
        return [(propose_ngram(ids, k, self.max_n, self.min_n), None) for _, ids, k in batch]


def early_exit_model(target: Transformer, n_layers: int) -> Transformer:
    """The target's first n_layers blocks + its final norm and LM head as a model of its own: a draft (lesson
    10) or a cascade's small model that needs no training and no memory (every part is the target's own)."""
    if not 1 <= n_layers < len(target.layers):
        raise ValueError(f"n_layers must be in 1..{len(target.layers) - 1}, got {n_layers}")
    small = empty_model(target.config.with_(n_layers=n_layers), attn_backend=target.attn_backend)
    small.embed, small.norm, small.lm_head = target.embed, target.norm, target.lm_head
    small.layers = torch.nn.ModuleList(list(target.layers[:n_layers]))
    small.rope_cos, small.rope_sin = target.rope_cos, target.rope_sin
    small.training = target.training  # the shared modules keep their own mode: nothing of the target changes
    return small


@dataclass
class _DraftState:
    block_table: BlockTable
    cached: list[int] = field(default_factory=list)  # the tokens whose keys/values the draft cache holds


class ModelDrafter(Drafter):
    """A draft language model (or the first `n_layers` blocks of one: early_exit_model) decoding k tokens
    ahead, batched: one PackedForward over every drafting sequence's new tokens per draft step.

    `num_blocks` x `block_size` bounds the draft KV cache; when it runs out, sequences outside the current batch
    are evicted (they re-prefill later) and a sequence that still does not fit drafts fewer tokens."""

    def __init__(self, model, n_layers: int | None = None, num_blocks: int = 1024, block_size: int = 16):
        if n_layers is not None and n_layers != len(model.layers):
            model = early_exit_model(model, n_layers)
        self.model = model
        self.cache = PagedKVCache(model.config, num_blocks, block_size, model.dtype, model.device,
                                  n_layers=len(model.layers))
        self.forward = PackedForward(model, self.cache)
        self.states: dict[str, _DraftState] = {}

    def check_target(self, target) -> None:
        """Refuse a draft that cannot speak for the target: another vocabulary or another device."""
        check_same_vocabulary(self.model, target, ("draft model", "target"),
                              "a draft must share the target's tokenizer")
        if self.model.device != target.device:
            raise ValueError(f"the draft model is on {self.model.device}, the target on {target.device}: move the "
                             f"draft with .to({str(target.device)!r})")

    def release(self, key: str) -> None:
        state = self.states.pop(key, None)
        if state is not None:
            state.block_table.free()

    def _sync(self, key: str, ids: list[int]) -> _DraftState:
        """Keep the cached prefix the sequence still agrees with (at least one token is left to run)."""
        state = self.states.get(key)
        if state is None:
            state = self.states[key] = _DraftState(BlockTable(self.cache.allocator))
        n, limit = 0, min(len(state.cached), len(ids) - 1)
        while n < limit and state.cached[n] == ids[n]:
            n += 1
        state.block_table.truncate(n)
        del state.cached[n:]
        return state

    def _reserve(self, state: _DraftState, n_tokens: int, busy: set[str]) -> bool:
        while not state.block_table.can_grow(n_tokens):  # evict draft caches of sequences not in the batch
            idle = next((k for k in self.states if k not in busy), None)
            if idle is None:
                return False
            self.release(idle)
        state.block_table.grow(n_tokens)
        return True

    @torch.inference_mode()
    def propose(self, batch: list[tuple[str, list[int], int]], params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> list[Proposal]:
        busy = {key for key, _, _ in batch}
        states = [self._sync(key, ids) for key, ids, _ in batch]
        drafts: list[list[int]] = [[] for _ in batch]
        probs: list[list[Tensor]] = [[] for _ in batch]
        wanted = [k for _, _, k in batch]
        for step in range(max(wanted, default=0)):
            active, new_tokens = [], []
            for i, ((_, ids, _), state) in enumerate(zip(batch, states)):
                if len(drafts[i]) < wanted[i]:
                    tokens = ids[len(state.cached):] if step == 0 else [drafts[i][-1]]
                    fits = len(state.cached) + len(tokens) <= self.model.config.max_seq_len  # the draft's window
                    if fits and self._reserve(state, len(state.cached) + len(tokens), busy):
                        active.append(i)
                        new_tokens.append(tokens)
                    else:
                        wanted[i] = len(drafts[i])  # out of draft cache or past its context: propose what it has
            if not active:
                break
            logits = self._forward([states[i] for i in active], new_tokens)
            for row, i in enumerate(active):
                p = params[i]
                q = logits_to_probs(logits[row:row + 1], p.temperature, p.top_k, p.top_p)  # one-hot when greedy
                token = int(logits[row].argmax()) if p.temperature == 0 else int(sample(q, generators[i])[0])
                drafts[i].append(token)
                probs[i].append(q[0])
        return [(d, torch.stack(q) if q else None) for d, q in zip(drafts, probs)]

    def _forward(self, states: list[_DraftState], new_tokens: list[list[int]]) -> Tensor:
        """Run each sequence's new tokens through the draft (one packed forward); logits at each one's last token."""
        chunks = []
        for state, tokens in zip(states, new_tokens):
            chunks.append(Chunk(state.block_table.block_ids, len(state.cached), tokens))
            state.cached += tokens
        return self.forward(chunks).float()


__all__ = ["Drafter", "ModelDrafter", "NgramDrafter", "OutOfBlocksError", "Proposal", "early_exit_model",
           "propose_ngram"]
