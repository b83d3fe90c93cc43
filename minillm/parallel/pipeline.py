"""Pipeline parallelism (GPipe): each rank runs a contiguous stage of the blocks (lesson 11).

Stage r holds blocks [a_r, b_r) (`stage_bounds`; stage 0 also the embedding, the last stage the norm and LM
head) and only hidden states cross to the next stage: weights and KV cache per rank shrink p-fold. The price
is the bubble: with m micro-batches (consecutive prompt chunks) the idle fraction is (p - 1) / (m + p - 1).
`gpipe_schedule` draws the grid, `pipeline_prefill` runs it with real sends, `measured_bubble` checks the
formula. `PipelineStage` decodes too: a pipeline makes a model fit, it does not make one sequence faster.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor, nn

from minillm.parallel.distributed import Comm
from minillm.kv_cache import KVCache


def stage_bounds(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous block ranges per stage, as even as possible (the first stages take one more when uneven)."""
    if not isinstance(n_stages, int) or not 1 <= n_stages <= n_layers:
        raise ValueError(f"a pipeline of {n_stages} stages needs 1 <= stages <= blocks ({n_layers}): every stage "
                         f"must hold at least one block")
    base, extra = divmod(n_layers, n_stages)
    bounds, start = [], 0
    for r in range(n_stages):
        end = start + base + (r < extra)
        bounds.append((start, end))
        start = end
    return bounds


def gpipe_schedule(n_stages: int, n_micro: int) -> list[list[int | None]]:
    """grid[t][r] = the micro-batch stage r runs at time step t (forward only), None where it idles (the bubble)."""
    if n_stages < 1 or n_micro < 1:
        raise ValueError(f"need at least one stage and one micro-batch, got {n_stages}, {n_micro}")
    return [[t - r if 0 <= t - r < n_micro else None for r in range(n_stages)]
            for t in range(n_micro + n_stages - 1)]


def bubble_fraction(n_stages: int, n_micro: int) -> float:
    """(p - 1) / (m + p - 1): the idle share of the GPipe grid."""
    return (n_stages - 1) / (n_micro + n_stages - 1)


class StageCache:
    """A KV cache for the stage's blocks only, addressed with the model's global block indices."""

    def __init__(self, model, start: int, end: int, max_len: int):
        self.inner = KVCache(model.config, 1, max_len, model.dtype, model.device, n_layers=end - start)
        self.offset = start

    def begin_forward(self, batch: int, n_new: int, positions: Tensor | None = None) -> Tensor:
        return self.inner.begin_forward(batch, n_new, positions)

    def attend(self, layer_id, q, k, v, attn):
        return self.inner.attend(layer_id - self.offset, q, k, v, attn)

    @property
    def seq_len(self) -> int:
        return self.inner.seq_len


class PipelineStage:
    """Rank r's stage: its blocks (the others are dropped, freeing their memory), its KV cache, its neighbours."""

    def __init__(self, model, comm: Comm, max_len: int):
        self.model, self.comm = model, comm
        self.rank, self.n_stages = comm.rank, comm.world_size
        self.start, self.end = stage_bounds(len(model.layers), self.n_stages)[self.rank]
        for i in range(len(model.layers)):
            if not self.start <= i < self.end:
                model.layers[i] = nn.Identity()  # never called: run_layers only visits this stage's slice
        self.cache = StageCache(model, self.start, self.end, max_len)
        self.first, self.last = self.rank == 0, self.rank == self.n_stages - 1
        self.events: list[tuple[int, float, float]] = []  # (micro-batch, start, end) of each compute on this stage

    def forward(self, ids: Tensor, micro: int = 0) -> Tensor | None:
        """Run one micro-batch (1, n) through this stage: receive (or embed), compute, send (or return logits of
        its last token)."""
        n, dim = ids.shape[1], self.model.config.dim
        h = self.model.embed_tokens(ids) if self.first else \
            self.comm.recv((1, n, dim), self.model.dtype, self.rank - 1, self.model.device)
        t0 = time.perf_counter()
        positions = self.cache.begin_forward(1, n, None)
        h = self.model.run_layers(h, positions[None], self.cache, layers=slice(self.start, self.end))
        out = self.model.logits(h, slice(-1, None)) if self.last else None
        self.events.append((micro, t0, time.perf_counter()))
        if not self.last:
            self.comm.send(h, self.rank + 1)
        return out

    def next_token(self, logits: Tensor | None) -> int:
        """The greedy token, decided by the last stage and broadcast to every stage."""
        tok = torch.zeros(1, dtype=torch.long, device=self.model.device)
        if self.last:
            tok[0] = logits[0, -1].argmax()
        return int(self.comm.broadcast(tok, self.n_stages - 1)[0])


def pipeline_prefill(stage: PipelineStage, ids: Tensor, n_micro: int) -> Tensor | None:
    """GPipe forward of the prompt as n_micro consecutive chunks; the last stage returns the last logits."""
    chunks = ids.tensor_split(n_micro, dim=1)
    if any(c.shape[1] == 0 for c in chunks):
        raise ValueError(f"{ids.shape[1]} prompt tokens cannot make {n_micro} micro-batches: use at most "
                         f"{ids.shape[1]}")
    out = None
    for i, chunk in enumerate(chunks):  # blocking sends/recvs make the stages run the GPipe grid by themselves
        out = stage.forward(chunk, i)
    return out


def measured_bubble(events_by_stage: list[list[tuple[int, float, float]]]) -> float:
    """1 - busy time / (stages x makespan), over the recorded compute intervals of every stage."""
    starts = [e[1] for ev in events_by_stage for e in ev]
    ends = [e[2] for ev in events_by_stage for e in ev]
    busy = sum(e[2] - e[1] for ev in events_by_stage for e in ev)
    return 1 - busy / (len(events_by_stage) * (max(ends) - min(starts)))


__all__ = ["PipelineStage", "StageCache", "bubble_fraction", "gpipe_schedule", "measured_bubble", "pipeline_prefill",
           "stage_bounds"]
