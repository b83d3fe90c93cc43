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
    """|W[i, j]| * ||X_j||_2: weight (out, in), act_norm (in,) = the L2 norm of input channel j over the tokens."""
    raise NotImplementedError("task 08.wanda: a weight matters as much as what it multiplies: input channel j's "
                              "norm scales every weight of column j, whatever its row")


def unstructured_mask(scores: Tensor, sparsity: float, per_row: bool = True) -> Tensor:
    """True = keep. Zero the lowest-scoring `sparsity` of each output row (per_row, Wanda's comparison group) or of
    the whole matrix (per_row=False, classic magnitude pruning). Exactly floor(sparsity * n) are zeroed per group."""
    raise NotImplementedError("task 08.wanda: each comparison group (a row, or the flattened matrix) gives up its "
                              "lowest scores; how many is a whole number, and where do they sit after a sort?")


# task 08.2to4 ------------------------------------------------------------------------------------------------


def semi_structured_mask(scores: Tensor, n: int = 2, m: int = 4) -> Tensor:
    """True = keep: the n highest-scoring weights of every m consecutive ones along each row (2:4 by default)."""
    raise NotImplementedError("task 08.2to4: view each row as runs of m consecutive scores, and pick inside each "
                              "run, not across the row")


# task 08.drop_blocks -----------------------------------------------------------------------------------------


def drop_blocks(model: Transformer, drop: list[int]) -> Transformer:
    """Remove blocks `drop` (indices into model.layers) in place; the config's n_layers follows."""
    raise NotImplementedError("task 08.drop_blocks: validate every index first; then a new container of the blocks "
                              "you keep, of the kind that registers them as submodules, and a config that agrees")
