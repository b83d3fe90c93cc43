"""The model runner (lesson 05): the only place that turns a schedule into tensors, runs the model, samples.

Continuous batching mixes prompts, prompt chunks, recomputed sequences, decodes and drafts in one step: the
runner makes each scheduled sequence a Chunk of one packed forward (cache/paged.py's PackedForward, which the
draft model runs too), so nothing is padded; then it samples per request (sampling.sample_batch: all greedy
rows in one argmax; penalties and min_tokens from each sequence's history) or verifies drafts (lesson 10). The
sampled ids come back to the host once per step; log-probabilities, when asked for, are of the raw logits.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from minillm.cache.paged import Chunk, PackedForward, PagedKVCache
from minillm.engine.scheduler import Schedule
from minillm.engine.sequence import Sequence
from minillm.sampling import sample_batch, token_logprobs
from minillm.speculative.decoding import verify


def debug_checks_enabled() -> bool:
    """MINILLM_DEBUG=1 turns on the per-step metadata checks (every block read is allocated, every block written has
    one owner). The tests set it; a server leaves it off."""
    return os.environ.get("MINILLM_DEBUG", "0") not in ("", "0")


class ModelRunner:
    def __init__(self, model, cache: PagedKVCache, max_num_batched_tokens: int = 512,
                 check_metadata: bool | None = None):
        self.model = model
        self.cache = cache
        check = debug_checks_enabled() if check_metadata is None else check_metadata
        self.forward = PackedForward(model, cache, max_num_batched_tokens, check)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @staticmethod
    def chunks(schedule: Schedule) -> list[Chunk]:
        """Each scheduled sequence's new tokens (and drafts) as one chunk; a sampling sequence wants the
        logits of its last token (which predicts the next one) and of each draft (checked by the row before
        it)."""
        return [Chunk(item.seq.block_table, item.start,
                      item.seq.all_ids[item.start:item.start + item.num_new_tokens] + item.draft_ids,
                      1 + len(item.draft_ids) if item.samples else 0)
                for item in schedule.scheduled]

    @torch.inference_mode()
    def run(self, schedule: Schedule, draft_probs: list[Tensor | None] | None = None) -> list[list[int]]:
        """One forward over the packed batch; the sampled tokens per scheduled sequence ([] for a mid-prompt chunk).

        A sequence with draft_ids (lesson 10) gets its drafts verified: the accepted ones and one token of the
        target's come back. draft_probs[i] is the distribution scheduled[i]'s drafts were drawn from (None: one-hot
        guesses, e.g. n-gram)."""
        if not schedule.scheduled:
            return []
        logits = self.forward(self.chunks(schedule))
        out: list[list[int]] = [[] for _ in schedule.scheduled]
        plain, plain_rows, row = [], [], 0
        for i, item in enumerate(schedule.scheduled):
            if not item.samples:
                continue
            n = 1 + len(item.draft_ids)
            if item.draft_ids:
                q = draft_probs[i] if draft_probs is not None else None
                out[i] = verify(logits[row:row + n], item.draft_ids, q, item.seq.params, item.seq.generator)
                if item.seq.params.logprobs:  # each emitted token under the row that scored it
                    record_logprobs(item.seq, logits[row:row + len(out[i])], out[i])
            else:
                plain.append(i)
                plain_rows.append(row)
            row += n
        if plain:  # every ordinary sample in one call (all greedy rows share one argmax)
            seqs = [schedule.scheduled[i].seq for i in plain]
            if len(plain_rows) < logits.shape[0]:
                logits = logits[torch.tensor(plain_rows, device=logits.device)]
            tokens, logprobs = sample_batch(logits, [s.params for s in seqs], [s.generator for s in seqs], seqs)
            for j, (i, tok) in enumerate(zip(plain, tokens)):
                out[i] = [tok]
                if seqs[j].params.top_logprobs:
                    record_logprobs(seqs[j], logits[j:j + 1], [tok])
                elif logprobs is not None and seqs[j].params.logprobs:
                    seqs[j].logprobs.append(logprobs[j])
        return out


def record_logprobs(seq: Sequence, logits: Tensor, tokens: list[int]) -> None:
    """Append each token's raw log-probability (and its row's params.top_logprobs alternatives) to seq; logits
    (len(tokens), vocab), the rows that scored them."""
    chosen, top = token_logprobs(logits, tokens, seq.params.top_logprobs)
    seq.logprobs += chosen
    if seq.params.top_logprobs:
        seq.top_logprobs += top
