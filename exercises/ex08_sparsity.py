"""Exercise 08: sparsity and pruning (lesson 08, "fewer weights").

Choose which of SmolLM2's weights to zero the Wanda way, build the 2:4 pattern that sparse tensor cores run, remove
whole blocks of the model, and score whole heads and channels the LLM-Pruner way. Fill in the six functions, then
grade your work:

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
- 08.taylor: LLM-Pruner's importance of a coupled structure, the first-order Taylor estimate of the loss change when
  all of its weights are removed. `group_score` turns per-matrix products w * dL/dw, reshaped (groups, -1), into one
  score per group (`vector`: |the sum over all of them|; `element`: the sum of every |w * g|). `taylor_importance`
  finds each structure's weights: a KV group is its KV head's rows of wk and wv, the rows of wq of the query heads
  that share it, and the columns of wo those query heads write; an FFN channel is its row of gate and up and its
  column of down.

Bad input is part of each task, and must raise ValueError before anything changes: a sparsity outside [0, 1), scores
that are not finite (NaN, inf: check_sparsity and _check_scores below do these two), a width that n:m groups do not
divide, an n:m without 0 < n < m, and block indices that are out of range (negative ones too), repeated, or all of
them.

08.taylor's grader builds each group's weights by hand (a mask per matrix) and checks your scores against the
directional derivative of the loss, measured by autograd on a tiny model, and against sums over the masks.
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

# given for 08.taylor: RULES ("vector", "element"), _weight (the weight a layer applies, float32: W, or W + s B A
# under a LoRA adapter) and _check_importance (ValueError on NaN or inf scores)
from minillm.compress.llm_pruner import RULES, _weight  # noqa: F401
from minillm.compress.pruning import _check_importance  # noqa: F401

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


# task 08.taylor ----------------------------------------------------------------------------------------------


def group_score(products: list[Tensor], rule: str) -> Tensor:
    """products: one tensor per weight matrix of a coupled structure, w * dL/dw reshaped (groups, -1), row g holding
    group g's weights -> (groups,): |the sum over every matrix| (`vector`) or the sum of each weight's |w * g|
    (`element`).

    ValueError for a rule not in RULES, for no products, or for products whose group counts (first dims) differ.
    Example: products [[[1., -2.]], [[0.5]]] (one group): vector |1 - 2 + 0.5| = 0.5, element 1 + 2 + 0.5 = 3.5.
    """
    raise NotImplementedError("task 08.taylor: see the docstring; `minillm hint 08 taylor` for hints")


def taylor_importance(model: Transformer, grads: dict[str, Tensor], rule: str = "element") -> tuple[Tensor, Tensor]:
    """(KV-group importance (n_layers, n_kv_heads), FFN-channel importance (n_layers, ffn_dim)) from gradients
    {"3.attn.wq": dL/dW of block 3's wq, ...} (every block's wq wk wv wo gate up down), float32 on the CPU.

    Per block, the products _weight(layer) * grad of each matrix, grouped with group_score: KV group j is rows
    j*hd .. (j+1)*hd - 1 of wk and wv (hd = config.head_dim), the rows of wq of its query heads (the group_size
    consecutive heads j*group_size .., each head_dim rows) and the same columns of wo; FFN channel c is row c of gate
    and up and column c of down. ValueError: a rule not in RULES, a fused model (no wq / gate: fuse=False), a
    gradient whose shape is not its weight's; the scores are checked with _check_importance. Example: SmolLM2 has 9
    query heads in 3 KV groups: group 1 is wk/wv rows 64..127 and the wq rows of heads 3, 4, 5 (192..383).
    """
    raise NotImplementedError("task 08.taylor: see the docstring; `minillm hint 08 taylor` for hints")
