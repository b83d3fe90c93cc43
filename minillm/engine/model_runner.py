"""The model runner: the only place that turns a schedule into tensors, runs the model and samples.

Continuous batching mixes sequences at different stages in one forward: a new prompt (prefill), the next chunk of a
long one, a preempted sequence being recomputed, and decodes of one token each. Padding them to one length would
waste most of the batch, so the runner *packs* them: every scheduled sequence's new tokens go into a single row
input_ids (1, N_total) with their own positions, and AttentionMetadata (minillm/paged_attention.py) tells the paged
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

from ..paged import AttentionMetadata, PagedKVCache
from ..sampling import sample_batch
from .scheduler import Schedule


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
            seq, start, n = item.seq, item.start, item.num_new_tokens
            ids += seq.all_ids[start:start + n]
            positions += range(start, start + n)
            tables.append(seq.block_table)
            context_lens.append(start + n)  # cached tokens after this step, the new ones included
            query_lens.append(n)
            if item.samples:
                sample_rows.append(len(ids) - 1)  # the sequence's last token predicts its next one
        meta = AttentionMetadata.build(tables, context_lens, query_lens, self.cache.block_size, self.device)
        return self._fill("_ids", ids)[None], self._fill("_positions", positions)[None], meta, sample_rows

    @torch.inference_mode()
    def run(self, schedule: Schedule) -> list[list[int]]:
        """One forward over the packed batch; the sampled tokens per scheduled sequence ([] for a mid-prompt chunk)."""
        if not schedule.scheduled:
            return []
        input_ids, positions, meta, sample_rows = self.prepare(schedule)
        self.cache.set_metadata(meta, check=self.check_metadata)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        logits = self.model(input_ids, positions=positions, kv_cache=self.cache, logits_at=rows)[0]
        sampling = [item.seq for item in schedule.scheduled if item.samples]
        tokens, logprobs = sample_batch(logits, [s.params for s in sampling], [s.generator for s in sampling])
        if logprobs is not None:
            for seq, lp in zip(sampling, logprobs):
                if seq.params.logprobs:
                    seq.logprobs.append(lp)
        it = iter(tokens)
        return [[next(it)] if item.samples else [] for item in schedule.scheduled]
