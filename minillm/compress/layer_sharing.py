"""Cross-layer weight sharing (ALBERT-style): neighbouring blocks use one set of Linear weights (lesson 07's aside).

ALBERT trains one block's weights for every layer; done after training, as here, two neighbours get one shared
weight (their mean, the L2-closest single weight to both, or the first one's), halving the blocks' Linear bytes.
`share_neighbours` rewrites a float model in place; bench codebook measures what that costs a pretrained model.
"""

from __future__ import annotations

import torch
from torch import nn

from minillm.compress.quant import is_quantized

MODES = ("mean", "first")


@torch.no_grad()
def share_neighbours(model: nn.Module, group: int = 2, mode: str = "mean") -> nn.Module:
    """Every `group` consecutive blocks share one module per Linear (the same nn.Linear object, so its weight is
    stored once and model_bytes counts it once); the norms stay per block. Returns the model."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
    if group < 1:
        raise ValueError(f"group must be >= 1 blocks, got {group}")
    if is_quantized(model):
        raise ValueError("this model is quantized: share weights before quantizing (load a fresh float model)")
    blocks = list(model.layers)
    for start in range(0, len(blocks), group):
        members = blocks[start:start + group]
        names = [n for n, m in members[0].named_modules() if isinstance(m, nn.Linear)]
        for name in names:
            linears = [b.get_submodule(name) for b in members]
            if any(type(m) is not nn.Linear for m in linears):
                raise ValueError(f"block {start}'s neighbours have no float nn.Linear {name}: blocks must match")
            shared = linears[0]
            if mode == "mean":
                shared.weight.copy_(torch.stack([m.weight.float() for m in linears]).mean(0).to(shared.weight.dtype))
            parent, _, child = name.rpartition(".")
            for b in members[1:]:
                setattr(b.get_submodule(parent) if parent else b, child, shared)
    return model
