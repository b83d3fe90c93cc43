"""Tensor parallelism (Megatron-LM): every rank holds a slice of every weight matrix (lesson 11).

Column parallel (output rows split, no communication) then row parallel (input columns split, one all-reduce
of partial sums): q/k/v and gate/up are column parallel, wo and down row parallel, so a block costs two
all-reduces whatever p is; the embedding and the tied LM head split along the vocabulary. A rank must hold
whole KV heads, so `TPPlan` replicates attention when the degree does not divide them. `shard_tensor_parallel`
turns a loaded model into rank r's shard in place; the forward is the model's own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minillm.parallel.distributed import Comm
from minillm.model import MLP, Attention, Block


@dataclass(frozen=True)
class TPPlan:
    """What a degree splits: attention by whole KV heads (or replicated), the MLP by channels, the vocabulary."""

    degree: int
    split_attention: bool

    @classmethod
    def for_config(cls, cfg, degree: int) -> TPPlan:
        if not isinstance(degree, int) or degree < 1:
            raise ValueError(f"the tensor-parallel degree must be an integer >= 1, got {degree!r}")
        for name, n in (("ffn_dim", cfg.ffn_dim), ("vocab_size", cfg.vocab_size)):
            if n % degree:
                raise ValueError(f"tensor parallelism splits {name} = {n} into {degree} equal slices: {degree} does "
                                 f"not divide it; choose a degree that divides {name}")
        split = cfg.n_kv_heads % degree == 0 and cfg.n_heads % degree == 0
        return cls(degree, split)

    def describe(self, cfg) -> str:
        if self.split_attention:
            return (f"tp={self.degree}: {cfg.n_heads // self.degree} query heads and {cfg.n_kv_heads // self.degree} "
                    f"KV head(s) per rank")
        return (f"tp={self.degree}: attention replicated ({cfg.n_kv_heads} KV heads cannot be split {self.degree} "
                f"ways without splitting a head group); MLP and vocabulary split")


def column_slice(weight: Tensor, rank: int, degree: int) -> Tensor:
    """Column parallel: rank's rows of W (out_features, in_features), i.e. its 1/degree of the output features, as a
    contiguous copy. y_r = x W_r^T is rank r's slice of y; concatenating the ranks' slices along the last dim
    gives y."""
    if weight.shape[0] % degree:
        raise ValueError(f"{weight.shape[0]} output features do not split into {degree} equal slices")
    n = weight.shape[0] // degree
    return weight[rank * n:(rank + 1) * n].clone(memory_format=torch.contiguous_format)


def row_slice(weight: Tensor, rank: int, degree: int) -> Tensor:
    """Row parallel: rank's columns of W, i.e. its 1/degree of the input features, as a contiguous copy. With x_r the
    same slice of x's last dim, x_r W_r^T is a partial sum; the sum over ranks (an all-reduce) is y."""
    if weight.shape[1] % degree:
        raise ValueError(f"{weight.shape[1]} input features do not split into {degree} equal slices")
    n = weight.shape[1] // degree
    return weight[:, rank * n:(rank + 1) * n].clone(memory_format=torch.contiguous_format)


def column_shard(linear: nn.Linear, rank: int, degree: int) -> nn.Linear:
    """Rank's slice of the output features (whole rows of W): no communication needed after it."""
    w = column_slice(linear.weight.detach(), rank, degree)
    out = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    out.weight = nn.Parameter(w, requires_grad=False)
    return out


class RowParallelLinear(nn.Module):
    """Rank's slice of the input features: a partial sum of the output, made whole by one all-reduce (`reduce`
    False leaves it partial: sequence parallelism reduce-scatters it instead)."""

    def __init__(self, linear: nn.Linear, rank: int, degree: int, comm: Comm, reduce: bool = True):
        super().__init__()
        self.weight = nn.Parameter(row_slice(linear.weight.detach(), rank, degree), requires_grad=False)
        self.comm, self.reduce = comm, reduce

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight)
        return self.comm.all_reduce(y) if self.reduce else y


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + vocab/p) of the embedding. Ids outside the slice look up zeros; the all-reduce fills
    each position from the one rank that owns its id (exact: the other ranks add zeros)."""

    def __init__(self, weight: Tensor, rank: int, degree: int, comm: Comm):
        super().__init__()
        n = weight.shape[0] // degree
        self.start, self.n, self.comm = rank * n, n, comm
        self.weight = nn.Parameter(weight.detach()[self.start:self.start + n].clone(), requires_grad=False)

    def partial(self, ids: Tensor) -> Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.n)
        return F.embedding(local.clamp(0, self.n - 1), self.weight) * mine[..., None].to(self.weight.dtype)

    def forward(self, ids: Tensor) -> Tensor:
        return self.comm.all_reduce(self.partial(ids))


class VocabParallelHead(nn.Module):
    """The LM head on the rank's vocabulary slice; an all-gather along the vocabulary makes the whole logits."""

    def __init__(self, weight: nn.Parameter, comm: Comm):
        super().__init__()
        self.weight, self.comm = weight, comm  # tied: the embedding shard's own parameter

    def forward(self, h: Tensor) -> Tensor:
        return self.comm.all_gather(F.linear(h, self.weight), dim=-1)


def shard_tensor_parallel(model, comm: Comm) -> TPPlan:
    """Turn `model` into this rank's tensor-parallel shard, in place. Refuses fused or quantized projections and an
    untied head (slice those before fusing/quantizing)."""
    cfg, rank, p = model.config, comm.rank, comm.world_size
    plan = TPPlan.for_config(cfg, p)
    if not cfg.tie_embeddings:
        raise ValueError("shard_tensor_parallel expects a tied embedding/LM head (SmolLM2's); this model's is untied")
    for i, block in enumerate(model.layers):
        checks = [("block", lambda: block, Block), ("attn", lambda: block.attn, Attention),
                  ("mlp", lambda: block.mlp, MLP)]
        checks += [(n, lambda n=n: block.get_submodule(n), nn.Linear) for n in
                   ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.gate", "mlp.up", "mlp.down")]
        for name, get, kind in checks:
            mod = get()
            if type(mod) is not kind:
                raise ValueError(f"block {i}: {name} is {type(mod).__name__}, not a plain {kind.__name__}: shard the "
                                 f"model before fusing (lesson 06), quantizing (lesson 07) or otherwise rewriting it")
        if plan.split_attention:
            for name in ("wq", "wk", "wv"):
                setattr(block.attn, name, column_shard(getattr(block.attn, name), rank, p))
            block.attn.wo = RowParallelLinear(block.attn.wo, rank, p, comm)
            block.attn.n_heads, block.attn.n_kv_heads = cfg.n_heads // p, cfg.n_kv_heads // p
        block.mlp.gate = column_shard(block.mlp.gate, rank, p)
        block.mlp.up = column_shard(block.mlp.up, rank, p)
        block.mlp.down = RowParallelLinear(block.mlp.down, rank, p, comm)
    model.embed = VocabParallelEmbedding(model.embed.weight, rank, p, comm)
    model.lm_head = VocabParallelHead(model.embed.weight, comm)
    heads = {"n_heads": cfg.n_heads // p, "n_kv_heads": cfg.n_kv_heads // p} if plan.split_attention else {}
    # the shard's own shapes (KV caches are sized from them); head_dim stays explicit (config.py)
    model.config = replace(cfg, ffn_dim=cfg.ffn_dim // p, **heads)
    model.tp_plan, model.comm = plan, comm
    return plan


def tp_bytes_per_token(cfg, plan: TPPlan, dtype_bytes: int = 4) -> dict[str, int]:
    """Bytes handed to each collective per token of a forward (every row gets logits), from the plan alone: the
    formula the measured Comm counts are checked against."""
    per_block = 2 if plan.split_attention else 1  # after the output projection (if split) and after down
    return {"all_reduce": (cfg.n_layers * per_block + 1) * cfg.dim * dtype_bytes,  # + the embedding
            "all_gather": cfg.vocab_size * dtype_bytes}


__all__ = ["RowParallelLinear", "TPPlan", "VocabParallelEmbedding", "VocabParallelHead", "column_shard",
           "column_slice", "row_slice", "shard_tensor_parallel", "tp_bytes_per_token"]
