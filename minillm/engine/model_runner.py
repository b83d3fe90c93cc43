"""The model runner: the only place that turns a schedule into tensors, runs the model and samples.

Continuous batching mixes sequences at different stages in one forward: a new prompt (prefill), the next chunk of a
long one, a preempted sequence being recomputed, and decodes of one token each. Padding them to one length would
waste most of the batch, so the runner *packs* them: every scheduled sequence's new tokens go into a single row
input_ids (1, N_total) with their own positions, and AttentionMetadata (minillm/cache/paged_attention.py) tells the paged
cache where each token's key/value goes (slot_mapping) and what each sequence attends over (block tables, context
lengths, cu_seqlens of the queries). Only each sequence's last row reaches the LM head (`logits_at`): the
49152-wide projection of every prompt token would be wasted work.

The step's token ids and positions are copied into buffers allocated once (max_num_batched_tokens long), so the
model always reads the same storage: what CUDA graphs and a compiled decode need (lesson 06). Sampling is per
request (sampling.sample_batch: all greedy rows in one argmax); the sampled ids come back to the host once per step,
the one sync the scheduler needs. Lesson 05 explains the packing; lesson 04 the paged cache it writes into.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from minillm.cache.paged import AttentionMetadata, PagedKVCache
from minillm.sampling import sample_batch
from minillm.speculative.decoding import verify
from minillm.engine.scheduler import Schedule


def debug_checks_enabled() -> bool:
    """MINILLM_DEBUG=1 turns on the per-step metadata checks (every block read is allocated, every block written has
    one owner). The tests set it; a server leaves it off."""
    return os.environ.get("MINILLM_DEBUG", "0") not in ("", "0")


class ModelRunner:
    def __init__(self, model, cache: PagedKVCache, max_num_batched_tokens: int = 512, check_metadata: bool | None = None):
        self.model = model
        self.cache = cache
        self.check_metadata = debug_checks_enabled() if check_metadata is None else check_metadata
        # preallocated step inputs: a step fills a prefix of each; the longest step decides the size (grown if needed)
        self._ids = torch.zeros(max_num_batched_tokens, dtype=torch.long, device=self.device)
        self._positions = torch.zeros(max_num_batched_tokens, dtype=torch.long, device=self.device)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def _fill(self, name: str, values: list[int]) -> Tensor:
        buf = getattr(self, name)
        if len(values) > buf.numel():  # a step longer than max_num_batched_tokens (the static baseline): grow once
            buf = torch.zeros(len(values), dtype=buf.dtype, device=buf.device)
            setattr(self, name, buf)
        view = buf[: len(values)]
        view.copy_(torch.tensor(values, dtype=buf.dtype), non_blocking=True)
        return view

    def prepare(self, schedule: Schedule) -> tuple[Tensor, Tensor, AttentionMetadata, list[int]]:
        """input_ids, positions (1, N_total) views of the step buffers, the attention metadata and the packed rows
        whose logits are sampled (one per sampling sequence, its last token's row)."""
        ids: list[int] = []
        positions: list[int] = []
        tables, context_lens, query_lens, sample_rows = [], [], [], []
        for item in schedule.scheduled:
            seq, start, n = item.seq, item.start, item.num_new_tokens + len(item.draft_ids)
            ids += seq.all_ids[start:start + item.num_new_tokens] + item.draft_ids
            positions += range(start, start + n)
            tables.append(seq.block_table)
            context_lens.append(start + n)  # cached tokens after this step, the new ones included
            query_lens.append(n)
            if item.samples:  # the last token predicts the next one; each draft is checked by the row before it
                sample_rows += range(len(ids) - 1 - len(item.draft_ids), len(ids))
        meta = AttentionMetadata.build(tables, context_lens, query_lens, self.cache.block_size, self.device)
        return self._fill("_ids", ids)[None], self._fill("_positions", positions)[None], meta, sample_rows

    @torch.inference_mode()
    def run(self, schedule: Schedule, draft_probs: list[Tensor | None] | None = None) -> list[list[int]]:
        """One forward over the packed batch; the sampled tokens per scheduled sequence ([] for a mid-prompt chunk).

        A sequence with draft_ids (lesson 10) gets its drafts verified: the accepted ones and one token of the
        target's come back. draft_probs[i] is the distribution scheduled[i]'s drafts were drawn from (None: one-hot
        guesses, e.g. n-gram)."""
        if not schedule.scheduled:
            return []
        input_ids, positions, meta, sample_rows = self.prepare(schedule)
        self.cache.set_metadata(meta, check=self.check_metadata)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        logits = self.model(input_ids, positions=positions, kv_cache=self.cache, logits_at=rows)[0]
        out: list[list[int]] = [[] for _ in schedule.scheduled]
        plain, plain_rows, row = [], [], 0
        for i, item in enumerate(schedule.scheduled):
            if not item.samples:
                continue
            n = 1 + len(item.draft_ids)
            if item.draft_ids:
                q = draft_probs[i] if draft_probs is not None else None
                out[i] = verify(logits[row:row + n], item.draft_ids, q, item.seq.params, item.seq.generator)
                if item.seq.params.logprobs:
                    lp = logits[row:row + len(out[i])].float().log_softmax(dim=-1)
                    item.seq.logprobs += lp.gather(1, torch.tensor(out[i], device=lp.device)[:, None])[:, 0].tolist()
            else:
                plain.append(i)
                plain_rows.append(row)
            row += n
        if plain:  # every ordinary sample in one call (all greedy rows share one argmax)
            seqs = [schedule.scheduled[i].seq for i in plain]
            if len(plain_rows) < logits.shape[0]:
                logits = logits[torch.tensor(plain_rows, device=logits.device)]
            tokens, logprobs = sample_batch(logits, [s.params for s in seqs], [s.generator for s in seqs])
            for j, (i, tok) in enumerate(zip(plain, tokens)):
                out[i] = [tok]
                if logprobs is not None and seqs[j].params.logprobs:
                    seqs[j].logprobs.append(logprobs[j])
        return out
