"""Exercise 07 (reference solutions): int8 per-row and int4 group-wise (GGUF Q4_1) weight quantization, the 4-bit
packing, LLM.int8()'s matmul with outlier columns kept in float, and an int8 matvec that never dequantizes the weight.

Each function is a verbatim copy of minillm's own (see SAME_AS); tests/test_exercise_sync.py keeps them in sync.
"""

from __future__ import annotations

import torch
from torch import Tensor

from minillm.compress.llm_int8 import _int8_mm  # given: int8 (m, k) @ int8 (n, k).T -> int32 (m, n) (torch._int_mm)
from minillm.compress.quant import check_group_size  # given: the group size must be even and divide the input dim

SAME_AS = {
    "quantize_int8": "minillm.compress.quant",
    "dequantize_int8": "minillm.compress.quant",
    "quantize_int4": "minillm.compress.quant",
    "dequantize_int4": "minillm.compress.quant",
    "pack_int4": "minillm.compress.quant",
    "unpack_int4": "minillm.compress.quant",
    "quantize_rows_int8": "minillm.compress.llm_int8",
    "int8_matmul_with_outliers": "minillm.compress.llm_int8",
    "int8_matvec": "minillm.compress.llm_int8",
}

# task 07.int8 -----------------------------------------------------------------------------------------------


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """w (out, in) -> (q int8 (out, in), scale float32 (out,)): symmetric per row, w ~= q * scale[:, None]."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))  # an all-zero row: any scale is exact
    # clamp to +-127, not -128: a symmetric range keeps -q representable and zero exactly zero
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:
    """q int8 (out, in), scale (out,) -> float32 (out, in): q * scale per row."""
    return q.float() * scale.float()[:, None]


# task 07.int4 -----------------------------------------------------------------------------------------------


def quantize_int4(w: Tensor, group_size: int, bits: int = 4) -> tuple[Tensor, Tensor, Tensor]:
    """w (out, in) -> (codes uint8 (out, in) in [0, 2**bits - 1], scale (out, in // g), minimum (out, in // g)).

    Asymmetric round-to-nearest per group of `group_size` inputs, as GGUF's Q4_1: scale = (max - min) / 15
    (2**bits - 1 levels), code = floor((w - min) / scale + 0.5). scale and minimum are returned in float16 (what is
    stored); codes are computed before that rounding, as llama.cpp does. `bits` < 4 is for quality experiments (3-bit
    codes)."""
    out, n_in = w.shape
    check_group_size(n_in, group_size)
    groups = w.float().reshape(out, n_in // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    levels = 2 ** bits - 1
    scale = (hi - lo) / levels
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))  # a constant group: every code 0, w == minimum
    codes = torch.floor((groups - lo[..., None]) * inv[..., None] + 0.5).clamp(0, levels).to(torch.uint8)
    return codes.reshape(out, n_in), scale.half(), lo.half()


def dequantize_int4(codes: Tensor, scale: Tensor, minimum: Tensor, group_size: int) -> Tensor:
    """codes (out, in), scale/minimum (out, in // g) -> float32 (out, in): code * scale + minimum, per group."""
    out, n_in = codes.shape
    groups = codes.float().reshape(out, n_in // group_size, group_size)
    return (groups * scale.float()[..., None] + minimum.float()[..., None]).reshape(out, n_in)


def pack_int4(codes: Tensor) -> Tensor:
    """codes uint8 (..., n) in [0, 15], n even -> uint8 (..., n // 2): column 2j in the low nibble, 2j+1 high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs an even number of columns, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """The inverse of pack_int4: uint8 (..., n // 2) -> codes uint8 (..., n)."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


# task 07.outliers -------------------------------------------------------------------------------------------


def quantize_rows_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (tokens, in) -> (int8 (tokens, in), scale float32 (tokens,)): one symmetric scale per row (token)."""
    amax = x.float().abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(x.float() / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def int8_matmul_with_outliers(x: Tensor, q: Tensor, scale: Tensor, threshold: float = 6.0) -> tuple[Tensor, Tensor]:
    """y ~= x @ (q * scale[:, None]).T with the LLM.int8() decomposition. Returns (y float32, outlier column mask).

    x (tokens, in) float; q int8 (out, in), scale (out,) per output row (from quantize_int8).
    Columns j with any |x[:, j]| > threshold are multiplied in float; the rest as int8 x int8 -> int32."""
    x = x.float()
    outliers = (x.abs() > threshold).any(dim=0)  # (in,)
    regular = x.masked_fill(outliers, 0.0)
    xq, xs = quantize_rows_int8(regular)
    y = _int8_mm(xq, q).float() * xs[:, None] * scale.float()[None, :]
    if outliers.any():
        w_cols = q[:, outliers].float() * scale.float()[:, None]  # the weights stay int8 in memory
        y = y + x[:, outliers] @ w_cols.T
    return y, outliers


# task 07.matvec ---------------------------------------------------------------------------------------------


def int8_matvec(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """x (rows, in) float @ dequantize_int8(q, scale).T -> float32 (rows, out), never building the float weight.

    Each row of x gets its own int8 scale (quantize_rows_int8); the int8 x int8 product accumulates in int32 and
    reads the weight as stored, one byte per weight; the per-row scales of x and of q multiply the (rows, out)
    result. A batch-1 decode step reads every weight once, so this reads a quarter of a float32 weight's bytes."""
    if x.dim() != 2 or q.dim() != 2 or x.shape[1] != q.shape[1] or q.dtype != torch.int8 or \
            scale.shape != (q.shape[0],):
        raise ValueError(f"need x (rows, in), q int8 (out, in), scale (out,); got x {tuple(x.shape)}, q {q.dtype} "
                         f"{tuple(q.shape)}, scale {tuple(scale.shape)}")
    xq, xs = quantize_rows_int8(x)
    return _int8_mm(xq, q).float() * xs[:, None] * scale.float()[None, :]
