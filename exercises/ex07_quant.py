"""Exercise 07: quantization (lesson 07, "fewer bytes per weight").

Store SmolLM2's weights in 8 and 4 bits, and multiply int8 activations by int8 weights the LLM.int8() way. Fill in
the eight functions, then grade your work:

    minillm grade 07

- 07.int8: symmetric int8 per output row, w[n, :] ~= q[n, :] * scale[n], q in [-127, 127] (never -128).
- 07.int4: asymmetric 4-bit codes per group of `group_size` inputs of a row, w ~= code * scale + minimum, exactly
  GGUF's Q4_1 when group_size is 32 (the format SmolLM2's model file ships in), and two codes packed per byte.
- 07.outliers: LLM.int8()'s matmul: the input columns holding a value above the threshold are multiplied in float,
  every other column as int8 x int8 with int32 accumulation.

The graders compare bit for bit with the formats' rules on adversarial values (constant groups, exact halves, rows
of zeros, all 256 byte values), bound the rounding error, and finish by quantizing the real model with your
functions (swapped into minillm.compress.quant and minillm.compress.llm_int8): it must still answer Paris and keep its
perplexity. Calling minillm.compress.quant or minillm.compress.llm_int8 inside your answers is rejected.
"""

from __future__ import annotations

import torch  # noqa: F401  (you will need it)
from torch import Tensor

from minillm.compress.llm_int8 import _int8_mm  # noqa: F401  given: int8 (m, k) @ int8 (n, k).T -> int32 (m, n)
from minillm.compress.quant import check_group_size  # noqa: F401  given: the group size must be even and divide the input dim

# task 07.int8 -----------------------------------------------------------------------------------------------


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """w (out, in) -> (q int8 (out, in), scale float32 (out,)): symmetric per row, w ~= q * scale[:, None]."""
    raise NotImplementedError("task 07.int8: one scale per row, so that the row's largest |w| uses the whole "
                              "symmetric int8 range; what scale does a row of zeros get?")


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:
    """q int8 (out, in), scale (out,) -> float32 (out, in): the inverse of quantize_int8 (up to its rounding)."""
    raise NotImplementedError("task 07.int8: back to float32, each row by its own scale")


# task 07.int4 -----------------------------------------------------------------------------------------------


def quantize_int4(w: Tensor, group_size: int, bits: int = 4) -> tuple[Tensor, Tensor, Tensor]:
    """w (out, in) -> (codes uint8 (out, in) in [0, 2**bits - 1], scale (out, in // g), minimum (out, in // g)).

    Asymmetric round-to-nearest per group of `group_size` inputs, as GGUF's Q4_1: scale = (max - min) / 15,
    code = floor((w - min) / scale + 0.5). scale and minimum are returned in float16 (what is stored); codes are
    computed before that rounding, as llama.cpp does. `bits` < 4 is for quality experiments (3-bit codes)."""
    raise NotImplementedError("task 07.int4: view each row as groups of group_size consecutive inputs; each group "
                              "gets its own range, and a group whose range is 0 still needs valid codes")


def dequantize_int4(codes: Tensor, scale: Tensor, minimum: Tensor, group_size: int) -> Tensor:
    """codes (out, in), scale/minimum (out, in // g) -> float32 (out, in): code * scale + minimum, per group."""
    raise NotImplementedError("task 07.int4: every code of a group goes back through that group's scale and "
                              "minimum, in float32")


def pack_int4(codes: Tensor) -> Tensor:
    """codes uint8 (..., n) in [0, 15], n even -> uint8 (..., n // 2): column 2j in the low nibble, 2j+1 high."""
    raise NotImplementedError("task 07.int4: two codes per byte (shifts and ors on uint8); an odd column count "
                              "is a ValueError")


def unpack_int4(packed: Tensor) -> Tensor:
    """The inverse of pack_int4: uint8 (..., n // 2) -> codes uint8 (..., n)."""
    raise NotImplementedError("task 07.int4: the low and the high nibble of each byte, back in column order")


# task 07.outliers -------------------------------------------------------------------------------------------


def quantize_rows_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (tokens, in) -> (int8 (tokens, in), scale float32 (tokens,)): one symmetric scale per row (token)."""
    raise NotImplementedError("task 07.outliers: task 07.int8's quantization, applied to activations: one scale "
                              "per token")


def int8_matmul_with_outliers(x: Tensor, q: Tensor, scale: Tensor, threshold: float = 6.0) -> tuple[Tensor, Tensor]:
    """y ~= x @ (q * scale[:, None]).T with the LLM.int8() decomposition. Returns (y float32, outlier column mask).

    x (tokens, in) float; q int8 (out, in), scale (out,) per output row (from quantize_int8).
    Columns j with any |x[:, j]| > threshold are multiplied in float; the rest as int8 x int8 -> int32."""
    raise NotImplementedError("task 07.outliers: find the outlier columns first; quantize what is left per token "
                              "for the integer matmul, rescale its int32 result, and add the float part")
