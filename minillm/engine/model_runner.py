"""The model runner: the only place that turns a schedule into tensors, runs the model and samples.

Continuous batching mixes sequences at different stages in one forward: a new prompt (prefill), the next chunk of a
long one, a preempted sequence being recomputed, and decodes of one token each. Padding them to one length would
waste most of the batch, so the runner *packs* them: every scheduled sequence's new tokens go into a single row
input_ids (1, N_total) with their own positions, and AttentionMetadata (minillm/paged.py) tells the paged cache where
each token's key/value goes (slot_mapping) and what each sequence attends over (block tables, context lengths,
cu_seqlens of the queries). Only each sequence's last row reaches the LM head (`logits_at`): the 49152-wide
projection of every prompt token would be wasted work.

Sampling is per request (temperature, top-k, top-p, a seeded generator each), with all greedy requests grouped into
one argmax. Lesson 05 explains the packing; lesson 04 the paged cache it writes into.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..paged import AttentionMetadata, PagedKVCache
from ..sampling import sample_from_logits
from .scheduler import Schedule
from .sequence import Sequence


def sample_tokens(logits: Tensor, seqs: list[Sequence]) -> list[int]:
    """logits (num_seqs, vocab) -> one token per sequence, each with its own SamplingParams and generator."""
    tokens = [0] * len(seqs)
    greedy = [i for i, s in enumerate(seqs) if s.params.temperature == 0]
    if greedy:  # one argmax for every greedy request
        for i, tok in zip(greedy, logits[greedy].argmax(dim=-1).tolist()):
            tokens[i] = tok
    for i, seq in enumerate(seqs):
        if seq.params.temperature != 0:
            p = seq.params
            tokens[i] = int(sample_from_logits(logits[i:i + 1], p.temperature, p.top_k, p.top_p, seq.generator))
    return tokens


class ModelRunner:
    def __init__(self, model, cache: PagedKVCache, check_metadata: bool = True):
        self.model = model
        self.cache = cache
        self.check_metadata = check_metadata  # verify every read/written block is allocated (cheap on CPU)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def prepare(self, schedule: Schedule) -> tuple[Tensor, Tensor, AttentionMetadata, Tensor]:
        """input_ids, positions (1, N_total), the attention metadata and the rows whose logits are sampled."""
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
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)
        return as_tensor([ids]), as_tensor([positions]), meta, as_tensor(sample_rows)

    @torch.inference_mode()
    def run(self, schedule: Schedule) -> list[int | None]:
        """One forward over the packed batch; a sampled token per scheduled sequence (None for a mid-prompt chunk)."""
        if not schedule.scheduled:
            return []
        input_ids, positions, meta, sample_rows = self.prepare(schedule)
        self.cache.set_metadata(meta, check=self.check_metadata)
        logits = self.model(input_ids, positions=positions, kv_cache=self.cache, logits_at=sample_rows)[0]
        sampling = [item for item in schedule.scheduled if item.samples]
        tokens = iter(sample_tokens(logits, [item.seq for item in sampling]))  # (num_sampling,) in schedule order
        return [next(tokens) if item.samples else None for item in schedule.scheduled]
