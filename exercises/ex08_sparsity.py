"""Exercise 08: sparsity and pruning (lesson 08, "fewer weights").

Choose which of SmolLM2's weights to zero the Wanda way, build the 2:4 pattern that sparse tensor cores run, and
remove whole blocks of the model. Fill in the four functions, then grade your work:

    minillm grade 08

- 08.wanda: `wanda_scores` is |W[i, j]| * act_norm[j] (act_norm: the L2 norm of input channel j over calibration
  tokens), in float32 whatever the weight's dtype; an act_norm that is not one value per input channel is a
  ValueError. `unstructured_mask` returns a bool mask, True = keep, that drops exactly floor(sparsity * n) of the
  lowest scores in each row (n = the row's length), or in the whole matrix with per_row=False (n = every score).
- 08.2to4: `semi_structured_mask` keeps the n highest scores of every m consecutive ones along each row (2 of 4 by
  default): exactly n per group.
- 08.drop_blocks: `drop_blocks` removes blocks from model.layers in place and returns the model. The result is still
  an nn.ModuleList (so that model.to(...), state_dict() and the engine see the blocks), the remaining blocks keep
  their order, and model.config says how many there are now (ModelConfig is frozen: config.with_(n_layers=...)).

Bad input is part of each task, and must raise ValueError before anything changes: a sparsity outside [0, 1), scores
that are not finite (NaN, inf: check_sparsity and _check_scores below do these two), a width that n:m groups do not
divide, an n:m without 0 < n < m, and block indices that are out of range (negative ones too), repeated, or all of
them.

The graders compare with brute-force oracles written group by group (every kept score at least every dropped one,
exactly the right count per row, per group, per matrix; ties may go either way), on random shapes and on scores full
of ties, and check the pruned tiny model against running the kept blocks by hand. The real-model task then prunes
SmolLM2 with your functions (swapped into minillm.compress.sparsity): Wanda at 50% must keep its perplexity within 2x
the dense model's, the 2:4 model must be 2:4 in every block (perplexity within 7x), and with its 4 least important
blocks dropped it must still generate, in generate() and in the engine. Calling minillm.compress.sparsity or
minillm.compress.pruning inside your answers is rejected.
"""

from __future__ import annotations

import torch  # noqa: F401  (you will need it)
from torch import Tensor, nn  # noqa: F401

# given: Transformer (the model class: drop_blocks' annotation), check_sparsity (ValueError unless
# 0 <= sparsity < 1) and _check_scores (ValueError unless the scores are a 2-D matrix of finite numbers)
from minillm.model import Transformer
from minillm.compress.sparsity import _check_scores, check_sparsity  # noqa: F401

# task 08.wanda -----------------------------------------------------------------------------------------------


def wanda_scores(weight: Tensor, act_norm: Tensor) -> Tensor:
    """|W[i, j]| * ||X_j||_2: weight (out, in), act_norm (in,) = the L2 norm of input channel j over the tokens.

    float32 (out, in) whatever the weight's dtype, with no autograd history; an act_norm of any other shape than
    (in,) is a ValueError. Example: W = [[1., -2.], [3., 0.5]], act_norm = [10., 1.]: [[10., 2.], [30., 0.5]], so
    W[0, 1] = -2 now scores below W[0, 0] = 1.
    """
    raise NotImplementedError("task 08.wanda: see the docstring; `minillm hint 08 wanda` for hints")


def unstructured_mask(scores: Tensor, sparsity: float, per_row: bool = True) -> Tensor:
    """True = keep. Zero the lowest-scoring `sparsity` of each output row (per_row, Wanda's comparison group) or of
    the whole matrix (per_row=False, classic magnitude pruning). Exactly floor(sparsity * n) are zeroed per group.

    A bool mask of the scores' shape. Every kept score of a group is >= every dropped one (ties may go either way,
    but the count is exact). The given check_sparsity and _check_scores refuse a sparsity outside [0, 1) and
    non-finite scores, before any work. Example: scores [[4., 1., 3., 2.], [1., 1., 9., 9.]], sparsity 0.5: per row
    [[T, F, T, F], [F, F, T, T]]; per_row=False drops the 4 lowest of all 8: the two 1.s of row 1, the 1. and the 2.
    of row 0.
    """
    raise NotImplementedError("task 08.wanda: see the docstring; `minillm hint 08 wanda` for hints")


# task 08.2to4 ------------------------------------------------------------------------------------------------


def semi_structured_mask(scores: Tensor, n: int = 2, m: int = 4) -> Tensor:
    """True = keep: the n highest-scoring weights of every m consecutive ones along each row (2:4 by default).

    Exactly n True in every run of m (columns m*g .. m*g + m - 1 of a row), never counted across the row or down a
    column. ValueError when m does not divide the row width, when not 0 < n < m, and on non-finite scores
    (_check_scores). Example: one row [5., 1., 2., 8., 0., 3., 3., 1.], 2:4: [T, F, F, T, F, T, T, F] (in the second
    run the two 3.s win).
    """
    raise NotImplementedError("task 08.2to4: see the docstring; `minillm hint 08 2to4` for hints")


# task 08.drop_blocks -----------------------------------------------------------------------------------------


def drop_blocks(model: Transformer, drop: list[int]) -> Transformer:
    """Remove blocks `drop` (indices into model.layers) in place; the config's n_layers follows.

    Returns the same model object. Refused with ValueError, the model untouched: an index outside 0 .. n - 1
    (negatives too, and bools), a repeated index, or dropping every block. The kept blocks stay in their order, in
    an nn.ModuleList (so .to(), state_dict() and the engine see them), and model.config is replaced by one with the
    new n_layers (ModelConfig is frozen: config.with_). Example: 30 blocks, drop [3, 1]: 28 blocks, the old 0, 2,
    4, 5, ... in that order, config.n_layers 28; drop [30] or [1, 1] raise and leave 30 blocks.
    """
    raise NotImplementedError("task 08.drop_blocks: see the docstring; `minillm hint 08 drop_blocks` for hints")
