"""Where speculative decoding's guesses come from: three draft sources behind one `propose` call (lesson 10).

A drafter looks at a sequence's tokens so far and guesses the next k. The target model then checks all k in one
forward (minillm/speculative/decoding.py); every guess it accepts is a decode step saved. A good drafter is cheap next to the
target and often right; the three here sit at different points of that trade:

  NgramDrafter    prompt lookup: find the most recent earlier occurrence of the sequence's last n tokens and propose
                  what followed it. No model, no memory, ~free; right whenever the output copies its input
                  (summaries, edits, extraction, code) and silent otherwise (it then proposes nothing).
  ModelDrafter    a small language model decoding k tokens ahead: the distilled student of lesson 09, or
                  early exit, the target's own first n blocks + its final norm and head (no training, shares
                  the weights). It keeps its own paged KV cache per sequence, batched over every sequence it drafts
                  for, and brings it in step with what the target accepted by itself: the cached prefix is compared
                  with the sequence's tokens and cut where they differ (rejected drafts vanish, freed blocks return).

    drafter.propose([("req-0", ids, 4)], [params], [generator]) -> [(draft_ids, q)]
q is (len(draft_ids), vocab): the distribution each draft token was drawn from (after the request's temperature,
top-k and top-p), or None for a drafter with no distribution (n-gram: a one-hot guess).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from minillm.cache.block_allocator import OutOfBlocksError, blocks_needed
from minillm.cache.paged import AttentionMetadata, PagedKVCache
from minillm.sampling import SamplingParams, logits_to_probs, sample

Proposal = tuple[list[int], Tensor | None]


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


class NgramDrafter:
    """Prompt lookup decoding (propose_ngram): no model, no state."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not isinstance(max_n, int) or not isinstance(min_n, int) or not 1 <= min_n <= max_n:
            raise ValueError(f"need integers 1 <= min_n <= max_n, got min_n={min_n!r}, max_n={max_n!r}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, batch: list[tuple[str, list[int], int]], params: list[SamplingParams] | None = None,
                generators: list | None = None) -> list[Proposal]:
        return [(propose_ngram(ids, k, self.max_n, self.min_n), None) for _, ids, k in batch]

    def release(self, key: str) -> None:
        pass


@dataclass
class _DraftState:
    block_table: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)  # the tokens whose keys/values the draft cache holds


class ModelDrafter:
    """A draft language model (or the first `n_layers` blocks of one) decoding k tokens ahead, batched.

    `num_blocks` x `block_size` bounds the draft KV cache; when it runs out, sequences outside the current batch
    are evicted (they re-prefill later) and a sequence that still does not fit drafts fewer tokens."""

    def __init__(self, model, n_layers: int | None = None, num_blocks: int = 1024, block_size: int = 16):
        n_layers = len(model.layers) if n_layers is None else n_layers
        if not 1 <= n_layers <= len(model.layers):
            raise ValueError(f"n_layers must be in 1..{len(model.layers)} (the draft model's blocks), got {n_layers}")
        self.model, self.layers = model, slice(0, n_layers)
        self.cache = PagedKVCache(model.config, num_blocks, block_size, model.dtype, model.device, n_layers=n_layers)
        self.states: dict[str, _DraftState] = {}

    def check_target(self, target) -> None:
        """Refuse a draft that cannot speak for the target: another vocabulary or another device."""
        if self.model.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary has {self.model.config.vocab_size} tokens, the target's "
                             f"{target.config.vocab_size}: a draft must share the target's tokenizer")
        if self.model.device != target.device:
            raise ValueError(f"the draft model is on {self.model.device}, the target on {target.device}: move the "
                             f"draft with .to({str(target.device)!r})")

    def release(self, key: str) -> None:
        state = self.states.pop(key, None)
        if state is not None:
            self.cache.allocator.free(state.block_table)

    def _sync(self, key: str, ids: list[int]) -> _DraftState:
        """Keep the cached prefix the sequence still agrees with (at least one token is left to run)."""
        state = self.states.setdefault(key, _DraftState())
        n, limit = 0, min(len(state.cached), len(ids) - 1)
        while n < limit and state.cached[n] == ids[n]:
            n += 1
        keep = blocks_needed(n, self.cache.block_size)
        self.cache.allocator.free(state.block_table[keep:])
        del state.block_table[keep:], state.cached[n:]
        return state

    def _reserve(self, state: _DraftState, n_tokens: int, busy: set[str]) -> bool:
        missing = blocks_needed(n_tokens, self.cache.block_size) - len(state.block_table)
        while missing > 0 and not self.cache.allocator.can_allocate(missing):
            idle = next((k for k in self.states if k not in busy), None)
            if idle is None:
                return False
            self.release(idle)
        if missing > 0:
            state.block_table += self.cache.allocator.allocate(missing)
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
        ids, positions, lens, rows = [], [], [], []
        for state, tokens in zip(states, new_tokens):
            positions += range(len(state.cached), len(state.cached) + len(tokens))
            ids += tokens
            state.cached += tokens
            lens.append(len(tokens))
            rows.append(len(ids) - 1)
        meta = AttentionMetadata.build([s.block_table for s in states], [len(s.cached) for s in states], lens,
                                       self.cache.block_size, self.model.device)
        self.cache.set_metadata(meta, check=False)
        dev = self.model.device
        h = self.model.embed_tokens(torch.tensor([ids], device=dev))
        pos = self.cache.begin_forward(1, len(ids), torch.tensor([positions], device=dev))
        h = self.model.run_layers(h, pos, self.cache, layers=self.layers)
        return self.model.logits(h, torch.tensor(rows, device=dev))[0].float()


__all__ = ["ModelDrafter", "NgramDrafter", "OutOfBlocksError", "Proposal", "propose_ngram"]
