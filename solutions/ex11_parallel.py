"""Exercise 11 (reference solutions): the column- and row-parallel slices of a linear layer, the collectives of a
tensor-parallel forward (the row-parallel all-reduce, the vocabulary-parallel embedding and head), and the GPipe grid.

Each function is a verbatim copy of minillm's own (see SAME_AS); tests/test_exercise_sync.py keeps them in sync.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minillm.parallel.distributed import Comm  # given: the counted collectives (all_reduce, all_gather, ...)

SAME_AS = {
    "column_slice": "minillm.parallel.tensor",
    "row_slice": "minillm.parallel.tensor",
    "RowParallelLinear": "minillm.parallel.tensor",
    "VocabParallelEmbedding": "minillm.parallel.tensor",
    "VocabParallelHead": "minillm.parallel.tensor",
    "gpipe_schedule": "minillm.parallel.pipeline",
}

# task 11.shard ------------------------------------------------------------------------------------------------


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


# task 11.collectives ------------------------------------------------------------------------------------------


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


# task 11.gpipe ------------------------------------------------------------------------------------------------


def gpipe_schedule(n_stages: int, n_micro: int) -> list[list[int | None]]:
    """grid[t][r] = the micro-batch stage r runs at time step t (forward only), None where it idles (the bubble)."""
    if n_stages < 1 or n_micro < 1:
        raise ValueError(f"need at least one stage and one micro-batch, got {n_stages}, {n_micro}")
    return [[t - r if 0 <= t - r < n_micro else None for r in range(n_stages)]
            for t in range(n_micro + n_stages - 1)]
