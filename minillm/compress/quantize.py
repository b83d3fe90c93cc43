"""quantize(model, scheme): the scheme registry above the layer types (lesson 07), gpt-fast style: every nn.Linear
(and the tied LM head with its embedding) is swapped for a quantized layer; the model code does not change."""

from __future__ import annotations

from torch import nn

from minillm.compress.llm_int8 import LLMInt8Linear
from minillm.compress.quant import Int4Linear, Int8Linear, QuantizedEmbedding, check_group_size, is_quantized
from minillm.model import replace_linears

SCHEMES = {
    "int8": "int8 weight-only, per output channel (symmetric)",
    "int4": "int4 weight-only, group-wise asymmetric round-to-nearest (group_size 32/64/128)",
    "llm.int8": "LLM.int8(): int8 x int8 matmul with outlier activation columns kept in float (llm_int8.py)",
}


def quantize(model: nn.Module, scheme: str, group_size: int = 32, include_head: bool = True,
             threshold: float = 6.0) -> nn.Module:
    """Replace the model's Linear layers (in place) by quantized ones; returns the model.

    include_head also quantizes the LM head, and the embedding tied to it reads the same quantized storage.
    For AWQ, run awq.apply_awq(model, ...) first (it rescales weights), then quantize(model, "int4")."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; choose one of {list(SCHEMES)}")
    if is_quantized(model):
        raise ValueError("this model is already quantized: quantizing twice would re-round rounded weights. "
                         "Load a fresh model and quantize it once.")
    if scheme == "int4":
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear):
                check_group_size(m.in_features, group_size)

    def make(name: str, linear: nn.Linear) -> nn.Module | None:
        if name == "lm_head" and not include_head:  # an untied head is an ordinary Linear to replace_linears
            return None
        if scheme == "int8":
            return Int8Linear.from_linear(linear)
        if scheme == "int4":
            return Int4Linear.from_linear(linear, group_size)
        return LLMInt8Linear.from_linear(linear, threshold)

    dtype = model.dtype
    replace_linears(model, make)
    if include_head and isinstance(getattr(model, "lm_head", None), nn.Linear):
        tied = getattr(model.config, "tie_embeddings", False)
        model.lm_head = make("lm_head", model.lm_head)
        if tied:
            model.embed = QuantizedEmbedding(model.lm_head, dtype)
    model.quant_scheme = scheme
    return model
