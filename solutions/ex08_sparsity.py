"""Exercise 08 (reference solutions): Wanda's importance scores, the unstructured and 2:4 masks, dropping whole
blocks of the model, and LLM-Pruner's first-order Taylor importance of coupled structures.

Each function is a verbatim copy of minillm's own (see SAME_AS); tests/test_exercise_sync.py keeps them in sync.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

# given: Transformer (the model class: drop_blocks' annotation), check_sparsity (ValueError unless
# 0 <= sparsity < 1) and _check_scores (ValueError unless the scores are a 2-D matrix of finite numbers)
from minillm.model import Transformer
from minillm.compress.sparsity import _check_scores, check_sparsity

# given for 08.taylor: RULES ("vector", "element"), _weight (the weight a layer applies, float32: W, or W + s B A
# under a LoRA adapter) and _check_importance (ValueError on NaN or inf scores)
from minillm.compress.llm_pruner import RULES, _weight
from minillm.compress.pruning import _check_importance

SAME_AS = {
    "wanda_scores": "minillm.compress.sparsity",
    "unstructured_mask": "minillm.compress.sparsity",
    "semi_structured_mask": "minillm.compress.sparsity",
    "drop_blocks": "minillm.compress.pruning",
    "group_score": "minillm.compress.llm_pruner",
    "taylor_importance": "minillm.compress.llm_pruner",
}

# task 08.wanda -----------------------------------------------------------------------------------------------


def wanda_scores(weight: Tensor, act_norm: Tensor) -> Tensor:
    """|W[i, j]| * ||X_j||_2: weight (out, in), act_norm (in,) = the L2 norm of input channel j over the tokens."""
    if act_norm.shape != weight.shape[1:]:
        raise ValueError(f"act_norm must have one entry per input channel ({weight.shape[1]}), "
                         f"got shape {tuple(act_norm.shape)}")
    return weight.detach().float().abs() * act_norm.float()[None, :]


def unstructured_mask(scores: Tensor, sparsity: float, per_row: bool = True) -> Tensor:
    """True = keep. Zero the lowest-scoring `sparsity` of each output row (per_row, Wanda's comparison group) or of
    the whole matrix (per_row=False, classic magnitude pruning). Exactly floor(sparsity * n) are zeroed per group."""
    check_sparsity(sparsity)
    _check_scores(scores)
    flat = scores if per_row else scores.reshape(1, -1)
    n_drop = int(flat.shape[1] * sparsity)
    mask = torch.ones_like(flat, dtype=torch.bool)
    if n_drop:
        drop = torch.sort(flat, dim=1, stable=True).indices[:, :n_drop]  # stable: ties drop the earlier column
        mask.scatter_(1, drop, False)
    return mask.reshape(scores.shape)


# task 08.2to4 ------------------------------------------------------------------------------------------------


def semi_structured_mask(scores: Tensor, n: int = 2, m: int = 4) -> Tensor:
    """True = keep: the n highest-scoring weights of every m consecutive ones along each row (2:4 by default)."""
    _check_scores(scores)
    if not 0 < n < m:
        raise ValueError(f"an n:m pattern keeps 0 < n < m weights per group, got {n}:{m}")
    if scores.shape[1] % m:
        raise ValueError(f"{n}:{m} sparsity groups each row in runs of {m}: in_features {scores.shape[1]} is not "
                         f"divisible by {m} (prune this layer unstructured, or leave it dense)")
    groups = scores.reshape(scores.shape[0], -1, m)
    keep = torch.topk(groups, n, dim=-1, sorted=False).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
    return mask.reshape(scores.shape)


# task 08.drop_blocks -----------------------------------------------------------------------------------------


def drop_blocks(model: Transformer, drop: list[int]) -> Transformer:
    """Remove blocks `drop` (indices into model.layers) in place; the config's n_layers follows."""
    n = len(model.layers)
    bad = [i for i in drop if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n]
    if bad:
        raise ValueError(f"block indices must be in 0..{n - 1}, got {bad}")
    if len(set(drop)) != len(drop):
        raise ValueError(f"duplicate block indices in {sorted(drop)}")
    if len(drop) >= n:
        raise ValueError(f"cannot drop all {n} blocks: keep at least one")
    model.layers = nn.ModuleList(b for i, b in enumerate(model.layers) if i not in set(drop))
    model.config = model.config.with_(n_layers=len(model.layers))
    return model


# task 08.taylor ----------------------------------------------------------------------------------------------


def group_score(products: list[Tensor], rule: str) -> Tensor:
    """products: one tensor per weight matrix of a coupled structure, w * dL/dw reshaped (groups, -1), row g holding
    group g's weights -> (groups,): |the sum over every matrix| (`vector`: the loss change of removing the group at
    once) or the sum of each weight's |w * g| (`element`: no cancellation between weights)."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES} (LLM-Pruner's vector-wise or element-wise Taylor), got {rule!r}")
    if not products or len({p.shape[0] for p in products}) != 1:
        raise ValueError(f"products must be one or more (groups, -1) tensors with equal group counts, got shapes "
                         f"{[tuple(p.shape) for p in products]}")
    if rule == "vector":
        return sum(p.sum(1) for p in products).abs()
    return sum(p.abs().sum(1) for p in products)


def taylor_importance(model: Transformer, grads: dict[str, Tensor], rule: str = "element") -> tuple[Tensor, Tensor]:
    """(KV-group importance (n_layers, n_kv_heads), FFN-channel importance (n_layers, ffn_dim)) from gradients
    (weight_gradients or lora_gradients), in the shapes pruning.prune_kv_groups / prune_ffn_channels take."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES} (LLM-Pruner's vector-wise or element-wise Taylor), got {rule!r}")
    if not all(hasattr(b.attn, "wq") and hasattr(b.mlp, "gate") for b in model.layers):
        raise ValueError("importance is per wq/wk/wv/wo and gate/up/down: score an unfused model (fuse=False)")
    cfg = model.config
    hd, g, nkv = cfg.head_dim, cfg.group_size, cfg.n_kv_heads
    kv, ffn = torch.zeros(len(model.layers), nkv), torch.zeros(len(model.layers), cfg.ffn_dim)
    for i, b in enumerate(model.layers):
        def wg(part: str, name: str) -> Tensor:
            lin = getattr(getattr(b, part), name)
            grad = grads[f"{i}.{part}.{name}"]
            if grad.shape != lin.weight.shape:
                raise ValueError(f"the gradient of block {i} {name} is {tuple(grad.shape)}, its weight "
                                 f"{tuple(lin.weight.shape)}: gradients of another model")
            return _weight(lin) * grad
        q = wg("attn", "wq").reshape(nkv, g * hd, -1)  # a group's query heads are consecutive (head h -> h // g)
        o = wg("attn", "wo").reshape(-1, nkv, g * hd).transpose(0, 1)  # (group, dim, its columns)
        k, v = (wg("attn", n).reshape(nkv, hd, -1) for n in ("wk", "wv"))
        kv[i] = group_score([t.reshape(nkv, -1) for t in (q, k, v, o)], rule).cpu()
        gate, up = wg("mlp", "gate"), wg("mlp", "up")  # (ffn, dim): channel c is row c
        down = wg("mlp", "down").t()  # (ffn, dim): channel c is column c of down
        ffn[i] = group_score([gate, up, down], rule).cpu()
    _check_importance(kv, "KV group")
    _check_importance(ffn, "FFN channel")
    return kv, ffn
