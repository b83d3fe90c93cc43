"""Weight prepacking: each float32 Linear's weight also kept in the layout oneDNN's kernel reads (not in a lesson yet).

torch's default CPU float32 matmul streams a batch-1 decode's weights far below the memory's rate; oneDNN's kernel,
handed its weights in its own layout, streams them faster (by hand, 2-core AVX2 EPYC: the block matmuls 16 -> 23
GB/s, the 113 MB LM head 16 -> 35). `prepack(model)` swaps every float32 nn.Linear, the tied LM head included, for a
PackedLinear: the weight stays (state_dict, tying, other paths unchanged), a packed copy sits beside it (memory: a
second copy), as inductor's CPU "freezing" does in a compiled graph. Where the copy cannot serve (autograd, another
dtype or device) the plain matmul runs; a weight changed in place since packing is repacked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minillm.model import replace_linears


def why_not_prepack() -> str | None:
    """None where oneDNN's packed float32 linear can run, else why not."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    return None


class PackedLinear(nn.Linear):
    """An nn.Linear (same parameters, same state_dict) with its weight also kept in oneDNN's packed layout."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias  # the same Parameters: a tied head stays tied
        new._pack()
        return new

    def _pack(self) -> None:
        with torch.no_grad():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
        self._packed_version = self.weight._version  # an in-place change of the weight bumps it

    def _can_use_pack(self, x: Tensor) -> bool:
        return (x.device.type == "cpu" and x.dtype == torch.float32 and self.weight.dtype == torch.float32
                and self.weight.device.type == "cpu" and not (torch.is_grad_enabled() and self.weight.requires_grad)
                and not torch.compiler.is_compiling())

    def forward(self, x: Tensor) -> Tensor:
        if not self._can_use_pack(x):
            return F.linear(x, self.weight, self.bias)
        if self.weight._version != self._packed_version:  # pruned, fine-tuned or loaded in place since packing
            self._pack()
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


def prepack(model: nn.Module) -> nn.Module:
    """Swap `model`'s float32 CPU nn.Linear layers (and its LM head) for PackedLinear, in place; returns the model.
    Raises ValueError saying why where oneDNN cannot run (why_not_prepack)."""
    if (why := why_not_prepack()) is not None:
        raise ValueError(f"cannot prepack: {why}")

    def swap(name: str, linear: nn.Linear) -> nn.Module | None:
        usable = linear.weight.dtype == torch.float32 and linear.weight.device.type == "cpu"
        return PackedLinear.from_linear(linear) if usable and type(linear) is nn.Linear else None

    replace_linears(model, swap)
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear) and (packed := swap("lm_head", head)) is not None:
        model.lm_head = packed  # the tied head (replace_linears leaves it): its weight is still the embedding's
    return model
