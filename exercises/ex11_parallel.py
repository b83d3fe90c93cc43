"""Exercise 11: tensor and pipeline parallelism (lesson 11, "one model, several processes").

Tensor parallelism gives every rank a slice of every weight matrix; a pipeline gives every rank a stage of the
blocks and streams micro-batches through them. Write the two ways of slicing a linear layer and the GPipe grid,
then grade your work:

    minillm grade 11

- 11.shard: a linear layer computes y = x @ W.T with W of shape (out_features, in_features). Split over `degree`
  ranks in two ways:
  `column_slice(weight, rank, degree)` (column parallel) is rank's block of W's *rows*: its 1/degree of the output
  features, rows [rank * n, (rank + 1) * n) with n = out_features // degree. Then x @ column_slice(W, r, p).T is
  rank r's slice of y, and concatenating the p slices along the last dim, in rank order, gives y.
  `row_slice(weight, rank, degree)` (row parallel) is rank's block of W's *columns*: its 1/degree of the input
  features, columns [rank * n, (rank + 1) * n) with n = in_features // degree. With x_r the same block of x's last
  dim, x_r @ row_slice(W, r, p).T is a partial sum, and the plain sum of the p partials (the all-reduce) is y.
  Rank r holds contiguous block r, never every p-th row or column: the engine hands the column shards of q, k and v
  to attention as whole heads (rows r * n ... are heads r * n / head_dim, ...), and an MLP's up and down
  projections must agree on which channels a rank holds. Return a contiguous tensor of W's dtype, exactly W's
  values (no scaling: the all-reduce adds, it does not average), and leave W as it was. A degree that does not
  divide the dimension being split is a ValueError.
- 11.gpipe: `gpipe_schedule(n_stages, n_micro)` is the forward schedule of a GPipe pipeline of p = n_stages stages
  fed m = n_micro micro-batches: a list with one row per time step, each row a list of p entries, grid[t][r] = the
  micro-batch stage r works on at time step t, or None when it idles. Stage r runs micro-batch i at time step
  i + r (micro-batch i leaves stage r - 1 at step i + r - 1), so every stage runs micro-batches 0 .. m - 1 in
  order, and the grid has m + p - 1 rows. Its p * (p - 1) None slots are the bubble: an idle fraction of
  (p - 1) / (m + p - 1). Fewer than one stage or one micro-batch is a ValueError.

The graders compare with oracles written out in the grader, in one process: random weights and inputs (hypothesis
over shapes, degrees 1, 2 and 3), the concatenated column-parallel outputs and the summed row-parallel partials set
against x @ W.T, each shard against the block it must hold, and your W checked unchanged afterwards; GPipe grids
of crafted sizes against a grid built step by step, and the pipeline's rules (order, dependencies, the bubble) on
random sizes. The real-model task first runs your slices of SmolLM2's first block as three simulated ranks in the
grading process, then starts three real ranks (minillm.parallel.distributed.launch) that shard SmolLM2 with your
column_slice and row_slice (minillm.parallel.tensor.shard_tensor_parallel) and decode 16 greedy tokens of "The
capital of France is": they must be the single-process model's tokens, Paris included. Calling
minillm.parallel.tensor or minillm.parallel.pipeline inside your answers is rejected.
"""

from __future__ import annotations

import torch  # noqa: F401  (you may need it)
from torch import Tensor

# task 11.shard ------------------------------------------------------------------------------------------------


def column_slice(weight: Tensor, rank: int, degree: int) -> Tensor:
    """Column parallel: rank's rows of W (out_features, in_features), i.e. its 1/degree of the output features, as a
    contiguous copy. y_r = x W_r^T is rank r's slice of y; concatenating the ranks' slices along the last dim
    gives y."""
    raise NotImplementedError("task 11.shard: y = x @ W.T, so y's last dim indexes W's first (rows). Which contiguous "
                              "block of rows is rank's, and what must happen when degree does not divide their count?")


def row_slice(weight: Tensor, rank: int, degree: int) -> Tensor:
    """Row parallel: rank's columns of W, i.e. its 1/degree of the input features, as a contiguous copy. With x_r the
    same slice of x's last dim, x_r W_r^T is a partial sum; the sum over ranks (an all-reduce) is y."""
    raise NotImplementedError("task 11.shard: the same block of x's last dim meets the same block of W's columns; "
                              "a column block of a row-major matrix is strided in memory, so make it contiguous")


# task 11.gpipe ------------------------------------------------------------------------------------------------


def gpipe_schedule(n_stages: int, n_micro: int) -> list[list[int | None]]:
    """grid[t][r] = the micro-batch stage r runs at time step t (forward only), None where it idles (the bubble)."""
    raise NotImplementedError("task 11.gpipe: micro-batch i reaches stage r after r hand-offs. At time step t, "
                              "which micro-batch is that for stage r, when does it exist, and when has the last "
                              "stage finished the last one?")
