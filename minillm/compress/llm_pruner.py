"""Structured pruning by the loss's own first-order estimate: LLM-Pruner and LoRAPrune's importance (lesson 08).

pruning.py scores a KV group or an FFN channel by its activations. LLM-Pruner (Ma et al., 2023) asks the loss: a
group of coupled weights (a KV head with its query heads' rows of wq/wk/wv and columns of wo; a SwiGLU channel's rows
of gate/up and column of down) costs, removed, about |sum w * dL/dw| over its weights (Taylor to first order,
`vector`) or sum |w * dL/dw| per weight (`element`). LoRAPrune (Zhang et al., 2023) reads the same estimate without
the frozen weights' gradients: through LoRA's, dL/dW ~ dL/d(BA), so pruning can run while adapters train. The
surgery is pruning.py's, so every path runs the result; lesson 09's LoRA recovers it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from minillm.compress.calibration import calib_batch
from minillm.compress.lora import LoRALinear
from minillm.compress.pruning import _check_float_unfused, _check_importance
from minillm.model import Transformer

RULES = ("vector", "element")


def _loss(model: Transformer, calib_ids: list[int], window: int) -> Tensor:
    x = calib_batch(model, calib_ids, window)
    logits = model(x)[:, :-1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32 at least; float64 stays
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def weight_gradients(model: Transformer, calib_ids: list[int], window: int = 256) -> dict[str, Tensor]:
    """dL/dW of the calibration loss (next-token cross-entropy) for every block matmul, {"3.attn.wq": grad}; the
    model's own requires_grad flags are left as they were."""
    _check_float_unfused(model)
    names = {f"{i}.{part}.{n}": getattr(getattr(b, part), n) for i, b in enumerate(model.layers)
             for part, ns in (("attn", ("wq", "wk", "wv", "wo")), ("mlp", ("gate", "up", "down"))) for n in ns}
    params = {k: (m.base.weight if isinstance(m, LoRALinear) else m.weight) for k, m in names.items()}
    was = {k: p.requires_grad for k, p in params.items()}
    try:
        for p in params.values():
            p.requires_grad_(True)
            p.grad = None
        with torch.enable_grad():
            _loss(model, calib_ids, window).backward()
        return {k: p.grad.detach().float().clone() for k, p in params.items()}
    finally:
        for k, p in params.items():
            p.grad = None
            p.requires_grad_(was[k])


def lora_gradients(model: Transformer, calib_ids: list[int], window: int = 256) -> dict[str, Tensor]:
    """LoRAPrune's estimate of dL/dW from the adapters alone: with W' = W + s B A, dL/dW' = G is what both A and B
    see (dL/dB = s G A^T, dL/dA = s B^T G); G ~ (dL/dB A + B dL/dA) / s, the projection of G onto the adapters'
    tangent space: what a LoRA fine-tuning run computes anyway, no frozen weight's gradient needed."""
    adapters = {f"{i}.{part}.{n}": getattr(getattr(b, part), n) for i, b in enumerate(model.layers)
                for part, ns in (("attn", ("wq", "wk", "wv", "wo")), ("mlp", ("gate", "up", "down"))) for n in ns}
    if not all(isinstance(m, LoRALinear) for m in adapters.values()):
        raise ValueError("LoRAPrune reads the adapters' gradients: add LoRA first (minillm.compress.lora.add_lora)")
    for m in adapters.values():
        m.A.grad = m.B.grad = None
    with torch.enable_grad():
        _loss(model, calib_ids, window).backward()
    out = {k: ((m.B.grad @ m.A + m.B @ m.A.grad) / m.scale).detach().float() for k, m in adapters.items()}
    for m in adapters.values():
        m.A.grad = m.B.grad = None
    return out


def _weight(lin) -> Tensor:
    """The weight a layer applies: W, or W + s B A under an adapter (LoRAPrune scores the merged weight)."""
    if isinstance(lin, LoRALinear):
        return (lin.base.weight + lin.delta()).detach().float()
    return lin.weight.detach().float()


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
