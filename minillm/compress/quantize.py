"""quantize(model, scheme): the scheme registry above the layer types (lesson 07), gpt-fast style: every nn.Linear
(and the tied LM head with its embedding) is swapped for a quantized layer; the model code does not change.
describe_arithmetic(model) says what the swapped-in layers then compute in, scheme by scheme."""

from __future__ import annotations

import collections

from minillm_kernels import cpu_lowbit
from torch import nn

from minillm.compress.llm_int8 import LLMInt8Linear
from minillm.compress.quant import (Int4Linear, Int8Linear, QuantizedEmbedding, QuantizedLinear, check_group_size,
                                   is_quantized)
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


def _weight_format(m: QuantizedLinear) -> str:
    if isinstance(m, Int4Linear):
        return f"int4 g{m.group_size}" + (" (q4_1)" if m.group_size == 32 else "")
    if type(m) is Int8Linear:
        return "int8 per block of 32 (q8_0)" if m.per_block else "int8 per row"
    return type(m).__name__  # LLM.int8() and other schemes with their own matmul


def describe_arithmetic(model: nn.Module) -> str:
    """What the model's matmuls compute in, in one line: the storage format of the weights and the precision of the
    activations each kernel actually uses (a q4 model "in float32" does not multiply in float32)."""
    dtype = str(model.dtype).removeprefix("torch.")
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    if not layers:
        if getattr(model, "native_step", None) is not None:  # float32 weights read where they lie, in C++
            return f"weights and matmuls in {dtype} (minillm's {cpu_lowbit.load().isa} native step, f32_matmul.cpp)"
        return f"weights and matmuls in {dtype}"
    if layers[0].weight_storage.device.type == "cuda":
        formats = collections.Counter(_weight_format(m) for m in layers)
        return f"weights {', '.join(f'{n} x{c}' for n, c in formats.items())}; Triton kernels, activations {dtype}"
    paths = collections.defaultdict(collections.Counter)
    for m in layers:
        if m.uses_cpu_kernels():
            path = (f"activations int8 per block of 32, integer dot products, float32 accumulation (minillm's "
                    f"{cpu_lowbit.load().isa} kernels)")
        elif isinstance(m, LLMInt8Linear):
            path = "int8 x int8 with the outlier columns in float (LLM.int8())"
        else:
            path = "activations, scales and outputs rounded to bfloat16 inside torch's int4/int8 CPU kernels"
        paths[path][_weight_format(m)] += 1
    parts = [f"{', '.join(f'{n} x{c}' for n, c in formats.items())}: {path}" for path, formats in paths.items()]
    return "; ".join(parts) + f"; the rest in {dtype}"
