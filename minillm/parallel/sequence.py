"""Sequence parallelism (Megatron-SP, Korthikanti et al. 2022) on top of tensor parallelism (lesson 11).

Between the tensor-parallel regions every rank runs the norms and residual adds on the whole sequence; SP
splits that residual stream along the sequence: an all-gather before each region and a reduce-scatter after it
replace the all-reduce (the same bytes, p-fold smaller activations). `enable_sequence_parallel` wraps the
regions; `sp_forward` runs plain TP when p does not divide the token count (a decode step); `prefill_sp`
prefills the longest multiple of p with SP and the rest as TP, into the same KV cache.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from minillm.parallel.distributed import Comm
from minillm.parallel.tensor import RowParallelLinear


class SequenceParallelRegion(nn.Module):
    """Wraps a block's attention or MLP whose last linear is row parallel (left unreduced here)."""

    def __init__(self, inner: nn.Module, row: RowParallelLinear, comm: Comm):
        super().__init__()
        self.inner, self.comm = inner, comm
        row.reduce = False  # this region reduces: reduce-scatter when the sequence is split, else all-reduce
        self.split = False  # set per forward by sp_forward

    def forward(self, x: Tensor, *args) -> Tensor:
        if not self.split:
            return self.comm.all_reduce(self.inner(x, *args))
        full = self.comm.all_gather(x, dim=1)  # (b, s, dim): the matmuls need every token
        return self.comm.reduce_scatter(self.inner(full, *args), dim=1)  # back to (b, s/p, dim), summed over ranks


def enable_sequence_parallel(model) -> None:
    """After shard_tensor_parallel: wrap every block's attention (when split) and MLP in a SequenceParallelRegion."""
    comm = getattr(model, "comm", None)
    if comm is None or not hasattr(model, "tp_plan"):
        raise ValueError("sequence parallelism works on a tensor-parallel shard: call shard_tensor_parallel first")
    if not model.tp_plan.split_attention:
        raise ValueError(f"sequence parallelism needs attention split across ranks too: "
                         f"{model.tp_plan.describe(model.config)}")
    for block in model.layers:
        block.attn = SequenceParallelRegion(block.attn, block.attn.wo, comm)
        block.mlp = SequenceParallelRegion(block.mlp, block.mlp.down, comm)
    model.sequence_parallel = True


def _set_split(model, split: bool) -> None:
    for block in model.layers:
        block.attn.split = block.mlp.split = split


def sp_forward(model, input_ids: Tensor, kv_cache=None, last_only: bool = False) -> Tensor:
    """The model's forward with the residual stream split along the sequence when p divides the token count."""
    comm, p = model.comm, model.comm.world_size
    b, s = input_ids.shape
    positions = kv_cache.begin_forward(b, s, None) if kv_cache is not None else torch.arange(s)
    split = s % p == 0
    _set_split(model, split)
    if split:  # the embedding's partial lookups are summed and scattered in one collective
        h = comm.reduce_scatter(model.embed.partial(input_ids), dim=1)
    else:
        h = model.embed(input_ids)
    h = model.run_layers(h, positions.expand(b, s), kv_cache)
    if split:
        h = model.norm(h)  # on the local tokens, then gather them for the head
        h = comm.all_gather(h, dim=1)
        h = h[:, -1:] if last_only else h
        return model.lm_head(h)
    return model.logits(h, slice(-1, None) if last_only else None)


def prefill_sp(model, ids: Tensor, kv_cache) -> Tensor:
    """Prefill ids (1, s): the longest multiple of p tokens sequence-parallel, the rest tensor-parallel.
    Returns the last position's logits (1, 1, vocab)."""
    p = model.comm.world_size
    n = ids.shape[1] // p * p
    if n == ids.shape[1] or n == 0:
        return sp_forward(model, ids, kv_cache, last_only=True)
    sp_forward(model, ids[:, :n], kv_cache, last_only=True)
    return sp_forward(model, ids[:, n:], kv_cache, last_only=True)


def residual_bytes(cfg, n_tokens: int, p: int, sequence_parallel: bool, dtype_bytes: int = 4) -> int:
    """Bytes of one residual-stream activation (b = 1) a rank holds between the tensor-parallel regions."""
    return (n_tokens // p if sequence_parallel else n_tokens) * cfg.dim * dtype_bytes


__all__ = ["SequenceParallelRegion", "enable_sequence_parallel", "prefill_sp", "residual_bytes", "sp_forward"]
