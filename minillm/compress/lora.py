"""Low-rank adapters (LoRA): recover a pruned model by training a small update beside each frozen weight (lesson 09).

A pruned student (lesson 08) has lost whole blocks; the blocks it kept are still good. Full fine-tuning moves all
85M of its weights and keeps AdamW state for each (3 extra copies). LoRA (Hu et al. 2021; LoRAPrune and LLM-Pruner
use it to heal pruned models) freezes W and learns W + (alpha / r) * B @ A with A (r, in) and B (out, r): for
r = 32 about 5% of the parameters, so the weight gradients and optimizer state shrink by ~20x and what training
makes fits in a few MB. B starts at zero, so before training the adapted model is exactly the pruned one.
`merge_lora` folds each update into its weight: the served model is a plain Transformer again, at no extra cost.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

TARGETS = ("wq", "wk", "wv", "wo", "gate", "up", "down")  # every matmul of a block


class LoRALinear(nn.Module):
    """y = base(x) + (alpha / rank) * x @ A^T @ B^T, with base frozen."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
        self.base, self.rank, self.scale = base.requires_grad_(False), rank, alpha / rank
        self.A = nn.Parameter(torch.empty(rank, base.in_features, dtype=base.weight.dtype, device=base.weight.device))
        self.B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=base.weight.dtype, device=base.weight.device))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))  # nn.Linear's own init: the update starts as a random plane

    @property
    def weight(self) -> Tensor:
        return self.base.weight

    def delta(self) -> Tensor:
        """The full-size update (out, in) this adapter adds to the weight."""
        return (self.B @ self.A) * self.scale

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + (x @ self.A.t() @ self.B.t()) * self.scale


def add_lora(model: nn.Module, rank: int = 32, alpha: float = 64.0, targets: tuple[str, ...] = TARGETS
             ) -> list[str]:
    """Wrap every nn.Linear named in `targets` (inside the blocks; not the LM head) with a LoRALinear, in place.
    Freezes everything else except the norms (a few thousand values, trained as they are). Returns the names."""
    model.requires_grad_(False)
    wrapped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and type(child) is nn.Linear and name.startswith("layers"):
                setattr(module, child_name, LoRALinear(child, rank, alpha))
                wrapped.append(f"{name}.{child_name}")
    if not wrapped:
        raise ValueError(f"no nn.Linear named {targets} under model.layers: is the model fused or quantized? "
                         f"add adapters before fuse()/quantize()")
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") and name.startswith("layers"):
            p.requires_grad_(True)
    return wrapped


def lora_state(model: nn.Module) -> dict[str, Tensor]:
    """What training made: each adapter's merged update (out, in) as low-rank factors, and the block norms."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            out[f"{name}.A"] = module.A.detach().cpu().clone()
            out[f"{name}.B"] = (module.B.detach() * module.scale).cpu().clone()  # the scale folded into B
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") and name.startswith("layers"):
            out[name] = p.detach().cpu().clone()
    return out


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight and put the plain nn.Linear back, in place."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                child.base.weight += child.delta().to(child.base.weight.dtype)
                setattr(module, child_name, child.base)
    return model
