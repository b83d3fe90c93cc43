"""Exercise 11 (reference solutions): the column- and row-parallel slices of a linear layer and the GPipe grid.

Each function is a verbatim copy of minillm's own (see SAME_AS); tests/test_exercise_sync.py keeps them in sync.
"""

from __future__ import annotations

import torch
from torch import Tensor

SAME_AS = {
    "column_slice": "minillm.parallel.tensor",
    "row_slice": "minillm.parallel.tensor",
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


# task 11.gpipe ------------------------------------------------------------------------------------------------


def gpipe_schedule(n_stages: int, n_micro: int) -> list[list[int | None]]:
    """grid[t][r] = the micro-batch stage r runs at time step t (forward only), None where it idles (the bubble)."""
    if n_stages < 1 or n_micro < 1:
        raise ValueError(f"need at least one stage and one micro-batch, got {n_stages}, {n_micro}")
    return [[t - r if 0 <= t - r < n_micro else None for r in range(n_stages)]
            for t in range(n_micro + n_stages - 1)]
