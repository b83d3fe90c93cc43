"""Exercise 11: tensor and pipeline parallelism (lesson 11, "one model, several processes").

Tensor parallelism gives every rank a slice of every weight matrix and puts a collective wherever a rank's partial
result must become everyone's; a pipeline gives every rank a stage of the blocks and streams micro-batches through
them. Write the two ways of slicing a linear layer, the collectives that make the slices one model, and the GPipe
grid, then grade your work:

    minillm grade 11

- 11.shard: `column_slice` and `row_slice`, rank r's share of a weight W (out_features, in_features) of y = x @ W.T:
  a contiguous block of its rows (the output features) or of its columns (the input features). Their docstrings
  give the contract.
- 11.collectives: the communication of a tensor-parallel forward, explicit, through a `Comm` (given: `all_reduce`
  sums a tensor over the ranks in place and returns it, `all_gather(x, dim)` concatenates every rank's x along dim,
  in rank order; each call is counted). `RowParallelLinear.forward` turns a row-parallel partial sum into the
  layer's output (a block has two: after attention's output projection and after the MLP's down projection);
  `VocabParallelEmbedding` looks up only its slice of the vocabulary and lets the collective fill in the rest;
  `VocabParallelHead` makes the whole logits from every rank's slice of the vocabulary. Their __init__ are given.
- 11.gpipe: `gpipe_schedule(n_stages, n_micro)`, the forward schedule of a GPipe pipeline (its docstring).

The graders compare with oracles written out in the grader, in one process: the slices against the blocks they must
hold and against x @ W.T (hypothesis over shapes, degrees 1-3); the collectives on ranks simulated by threads that
exchange through a counting Comm (each rank's output against the single-process layer in float64, and exactly the
collectives a forward needs: one all-reduce per row-parallel layer, none when told not to reduce), then a tiny
random model sharded on 3 thread ranks with your classes: the single-process logits, with 2 all-reduces per block, 1
for the embedding and 1 all-gather. GPipe grids against a grid built step by step. The real-model task runs SmolLM2
sharded over 3 ranks with your slices and your collectives: first as threads in the grading process, then as three
real processes (minillm.parallel.distributed.launch, gloo on CPU) that decode 16 greedy tokens of "The capital of
France is": the single-process model's logits and tokens, Paris included. Calling minillm.parallel.tensor or
minillm.parallel.pipeline inside your answers is rejected.
"""

from __future__ import annotations

import torch  # noqa: F401  (you may need them)
import torch.nn.functional as F  # noqa: F401
from torch import Tensor, nn

from minillm.parallel.distributed import Comm  # given: the counted collectives (all_reduce, all_gather, ...)

# task 11.shard ------------------------------------------------------------------------------------------------


def column_slice(weight: Tensor, rank: int, degree: int) -> Tensor:
    """Column parallel: rank's rows of W (out_features, in_features), i.e. its 1/degree of the output features, as a
    contiguous copy. y_r = x W_r^T is rank r's slice of y; concatenating the ranks' slices along the last dim
    gives y.

    Rank r holds the r-th of `degree` equal contiguous blocks of rows (never every degree-th row: the engine hands
    the shards of q, k and v to attention as whole heads), with W's values and dtype, in new contiguous memory; W
    itself is left as it was. A degree that does not divide out_features is a ValueError (in_features may be
    anything). Example: W with rows w0..w5, degree 3: rank 0 holds [w0, w1], rank 1 [w2, w3], rank 2 [w4, w5];
    degree 4 raises.
    """
    raise NotImplementedError("task 11.shard: see the docstring; `minillm hint 11 shard` for hints")


def row_slice(weight: Tensor, rank: int, degree: int) -> Tensor:
    """Row parallel: rank's columns of W, i.e. its 1/degree of the input features, as a contiguous copy. With x_r the
    same slice of x's last dim, x_r W_r^T is a partial sum; the sum over ranks (an all-reduce) is y.

    Rank r holds the r-th of `degree` equal contiguous blocks of columns, unscaled (the all-reduce adds the
    partials; it does not average them), W's dtype, new contiguous memory (a column block of a row-major matrix is
    strided: copy it), W untouched. A degree that does not divide in_features is a ValueError. Example: W (2, 4) =
    [[1, 2, 3, 4], [5, 6, 7, 8]], degree 2: rank 0 holds [[1, 2], [5, 6]], rank 1 [[3, 4], [7, 8]]; for x = [1, 1,
    1, 1] the partials are [3, 11] and [7, 15], and their sum [10, 26] is x @ W.T.
    """
    raise NotImplementedError("task 11.shard: see the docstring; `minillm hint 11 shard` for hints")


# task 11.collectives ------------------------------------------------------------------------------------------


class RowParallelLinear(nn.Module):
    """Rank's slice of the input features: a partial sum of the output, made whole by one all-reduce (`reduce`
    False leaves it partial: sequence parallelism reduce-scatters it instead)."""

    def __init__(self, linear: nn.Linear, rank: int, degree: int, comm: Comm, reduce: bool = True):
        super().__init__()
        self.weight = nn.Parameter(row_slice(linear.weight.detach(), rank, degree), requires_grad=False)
        self.comm, self.reduce = comm, reduce

    def forward(self, x: Tensor) -> Tensor:
        """x (..., in_features / degree): this rank's slice of the input -> (..., out_features).

        With `reduce`, the layer's whole output x_full @ W.T on every rank, made from the ranks' partial products
        x_r @ W_r.T with exactly one collective (self.comm); without it, the rank's own partial product and no
        collective at all. Example: 2 ranks, W = [[1, 2, 3, 4]], x_full = [1, 1, 1, 1]: rank 0 gets x_r = [1, 1]
        and computes 3, rank 1 computes 7; with reduce both return [10]; without, rank 0 returns [3]. Reducing twice
        would give [20]: the collective sums, in place, every time it is called.
        """
        raise NotImplementedError("task 11.collectives: see the docstring; `minillm hint 11 collectives` for hints")


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + vocab/p) of the embedding. Ids outside the slice look up zeros; the all-reduce fills
    each position from the one rank that owns its id (exact: the other ranks add zeros)."""

    def __init__(self, weight: Tensor, rank: int, degree: int, comm: Comm):
        super().__init__()
        n = weight.shape[0] // degree
        self.start, self.n, self.comm = rank * n, n, comm
        self.weight = nn.Parameter(weight.detach()[self.start:self.start + n].clone(), requires_grad=False)

    def partial(self, ids: Tensor) -> Tensor:
        """ids (...) of the whole vocabulary -> (..., dim): this rank's contribution, no communication.

        An id in [start, start + n) gives its row of the rank's slice (row id - start); any other id gives zeros,
        never another row (an index clamped into the slice would add a wrong embedding). Example: vocab 6 on 3
        ranks, rank 1 holds ids 2 and 3: ids [0, 3, 5] give [zeros, row of id 3, zeros].
        """
        raise NotImplementedError("task 11.collectives: see the docstring; `minillm hint 11 collectives` for hints")

    def forward(self, ids: Tensor) -> Tensor:
        """The whole embedding of `ids` on every rank, F.embedding(ids, full weight), with one collective over the
        ranks' partials (exact: for each position one rank adds its row, the others add zeros)."""
        raise NotImplementedError("task 11.collectives: see the docstring; `minillm hint 11 collectives` for hints")


class VocabParallelHead(nn.Module):
    """The LM head on the rank's vocabulary slice; an all-gather along the vocabulary makes the whole logits."""

    def __init__(self, weight: nn.Parameter, comm: Comm):
        super().__init__()
        self.weight, self.comm = weight, comm  # tied: the embedding shard's own parameter

    def forward(self, h: Tensor) -> Tensor:
        """h (..., dim) -> the whole logits (..., vocab) on every rank, with one collective.

        self.weight holds this rank's vocabulary rows (the embedding shard's: ids start .. start + n - 1), so h @
        weight.T is the rank's block of the logits; the blocks of ranks 0, 1, ... side by side along the last dim
        are the logits over the whole vocabulary. Example: vocab 6 on 3 ranks: rank 0 computes the logits of ids 0,
        1, rank 1 of ids 2, 3, rank 2 of 4, 5; every rank returns all six, in id order.
        """
        raise NotImplementedError("task 11.collectives: see the docstring; `minillm hint 11 collectives` for hints")


# task 11.gpipe ------------------------------------------------------------------------------------------------


def gpipe_schedule(n_stages: int, n_micro: int) -> list[list[int | None]]:
    """grid[t][r] = the micro-batch stage r runs at time step t (forward only), None where it idles (the bubble).

    p = n_stages stages fed m = n_micro micro-batches: a list of rows, one per time step, each a list of p entries.
    A micro-batch enters stage 0 at the step after the previous one did, and moves one stage on per step, so every
    stage runs micro-batches 0 .. m - 1 in order, each a step after the stage before it ran it; the grid ends when
    the last stage has run the last one. Its p(p - 1) None slots are the bubble, a fraction (p - 1) / (m + p - 1).
    Fewer than one stage or one micro-batch is a ValueError. Example: gpipe_schedule(2, 3) is [[0, None], [1, 0],
    [2, 1], [None, 2]].
    """
    raise NotImplementedError("task 11.gpipe: see the docstring; `minillm hint 11 gpipe` for hints")
