"""Exercise 07: quantization (lesson 07, "fewer bytes per weight").

Store SmolLM2's weights in 8 and 4 bits, multiply int8 activations by int8 weights the LLM.int8() way, and make a
decode step's matvec read the int8 weight as it is stored. Fill in the nine functions, then grade your work:

    minillm grade 07

- 07.int8: symmetric int8 per output row, w[n, :] ~= q[n, :] * scale[n], q in [-127, 127] (never -128).
- 07.int4: asymmetric 4-bit codes per group of `group_size` inputs of a row, w ~= code * scale + minimum, exactly
  GGUF's Q4_1 when group_size is 32 (the format SmolLM2's model file ships in), and two codes packed per byte.
- 07.outliers: LLM.int8()'s matmul: the input columns holding a value above the threshold are multiplied in float,
  every other column as int8 x int8 with int32 accumulation.
- 07.matvec: y ~= x @ dequantize_int8(q, scale).T for a few decode rows without building the float weight, timed
  against dequantize-then-matmul on SmolLM2's shapes.

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
    """w (out, in) -> (q int8 (out, in), scale float32 (out,)): symmetric per row, w ~= q * scale[:, None].

    Any float dtype in; the row's largest |w| maps to +-127 exactly, every value rounds to the nearest code, and q
    stays in [-127, 127] (never -128). A row of zeros gets codes 0 and a finite, nonzero scale (no 0 / 0). Example:
    w = [[0.5, -1.0, 0.25], [0., 0., 0.]]: scales [1/127, a finite s], q = [[64, -127, 32], [0, 0, 0]] (63.5 rounds
    half to even: 64).
    """
    raise NotImplementedError("task 07.int8: see the docstring; `minillm hint 07 int8` for hints")


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:
    """q int8 (out, in), scale (out,) -> float32 (out, in): the inverse of quantize_int8 (up to its rounding).

    Example: q = [[64, -127]], scale = [1/127] give [[0.5039, -1.0]]: each element within half a step of the original.
    """
    raise NotImplementedError("task 07.int8: see the docstring; `minillm hint 07 int8` for hints")


# task 07.int4 -----------------------------------------------------------------------------------------------


def quantize_int4(w: Tensor, group_size: int, bits: int = 4) -> tuple[Tensor, Tensor, Tensor]:
    """w (out, in) -> (codes uint8 (out, in) in [0, 2**bits - 1], scale (out, in // g), minimum (out, in // g)).

    Asymmetric round-to-nearest per group of `group_size` inputs, as GGUF's Q4_1: scale = (max - min) / 15,
    code = floor((w - min) / scale + 0.5). scale and minimum are returned in float16 (what is stored); codes are
    computed before that rounding, as llama.cpp does. `bits` < 4 is for quality experiments (3-bit codes).

    Groups are group_size consecutive inputs of a row (the given check_group_size refuses a size that is odd or
    does not divide the row); a constant group has scale 0 and codes 0, and must not compute 0 / 0. Rounding is
    floor(x + 0.5), which differs from torch.round at exact halves. Example: a group [0., 1., 2., 3.] with bits 2
    (3 steps): minimum 0, scale 1, codes [0, 1, 2, 3]; the group [1., 1., 1., 1.]: minimum 1, scale 0, codes 0.
    """
    raise NotImplementedError("task 07.int4: see the docstring; `minillm hint 07 int4` for hints")


def dequantize_int4(codes: Tensor, scale: Tensor, minimum: Tensor, group_size: int) -> Tensor:
    """codes (out, in), scale/minimum (out, in // g) -> float32 (out, in): code * scale + minimum, per group.

    Column j belongs to group j // group_size; float16 scale and minimum are widened to float32 first. Example: codes
    [[0, 3, 15, 1]], group_size 2, scale [[0.5, 2.]], minimum [[-1., 0.]]: [[-1., 0.5, 30., 2.]].
    """
    raise NotImplementedError("task 07.int4: see the docstring; `minillm hint 07 int4` for hints")


def pack_int4(codes: Tensor) -> Tensor:
    """codes uint8 (..., n) in [0, 15], n even -> uint8 (..., n // 2): column 2j in the low nibble, 2j+1 high.

    Any leading dims; an odd last dim is a ValueError. Example: codes [1, 2, 15, 0] pack to [0x21, 0x0F] = [33, 15].
    """
    raise NotImplementedError("task 07.int4: see the docstring; `minillm hint 07 int4` for hints")


def unpack_int4(packed: Tensor) -> Tensor:
    """The inverse of pack_int4: uint8 (..., n // 2) -> codes uint8 (..., n).

    Byte j gives columns 2j (its low four bits) and 2j + 1 (its high four bits). Example: [33, 15] unpack to
    [1, 2, 15, 0]; every byte value 0..255 must round-trip through pack_int4.
    """
    raise NotImplementedError("task 07.int4: see the docstring; `minillm hint 07 int4` for hints")


# task 07.outliers -------------------------------------------------------------------------------------------


def quantize_rows_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (tokens, in) -> (int8 (tokens, in), scale float32 (tokens,)): one symmetric scale per row (token).

    The same rule as quantize_int8 (largest |x| of a row at +-127, codes in [-127, 127], a row of zeros with a
    finite nonzero scale), applied to a batch of activations. Example: x = [[2., -1.]]: scale [2/127], codes
    [[127, -64]] (-63.5 rounds half to even).
    """
    raise NotImplementedError("task 07.outliers: see the docstring; `minillm hint 07 outliers` for hints")


def int8_matmul_with_outliers(x: Tensor, q: Tensor, scale: Tensor, threshold: float = 6.0) -> tuple[Tensor, Tensor]:
    """y ~= x @ (q * scale[:, None]).T with the LLM.int8() decomposition. Returns (y float32, outlier column mask).

    x (tokens, in) float; q int8 (out, in), scale (out,) per output row (from quantize_int8).
    Columns j with any |x[:, j]| > threshold are multiplied in float; the rest as int8 x int8 -> int32.

    The outlier mask is (in,) bool, True for a column where some token's |x| exceeds the threshold (strictly). The
    regular part is x with those columns zeroed, quantized per token (quantize_rows_int8), multiplied by q with the
    given _int8_mm (int32 accumulation) and scaled back by the token's and the weight row's scales; the outlier
    columns of x meet the dequantized weight columns in float32. y is float32 (tokens, out). Example: threshold 6,
    x = [[1., 50.], [2., -3.]]: column 1 is an outlier (50 > 6), so y = (int8 part of column 0) + x[:, 1:] times the
    weights' column 1 in float, and a single huge value no longer shrinks every other value's int8 resolution.
    """
    raise NotImplementedError("task 07.outliers: see the docstring; `minillm hint 07 outliers` for hints")


# task 07.matvec ---------------------------------------------------------------------------------------------


def int8_matvec(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """x (rows, in) float @ dequantize_int8(q, scale).T -> float32 (rows, out), never building the float weight.

    q int8 (out, in) and scale float32 (out,) as quantize_int8 returns them; x holds a few decode rows (1 to 8).
    A decode step reads every weight once, so the time is the weight's bytes: read q as int8 (1 byte a weight), not
    a float32 copy of it (4 bytes, written and read again on every call). torch multiplies int8 only by int8, so x
    meets q as int8 too: each row of x with its own int8 scale (the rule of quantize_rows_int8), the int8 x int8
    product accumulated in int32 (the given _int8_mm), and the scales of x's rows and q's rows applied to the
    (rows, out) result, never to the (out, in) weight.

    What must hold: y is float32 (rows, out), within half of row t's int8 step (max |x[t]| / 127) times sum_k
    |w[n, k]| of the float product x @ w.T (w the dequantized weight), a row of zeros gives zeros; x not 2-D, a q
    that is not int8 or whose width differs from x's, or a scale that is not (out,) is a ValueError. Timed on one
    row through SmolLM2's weights (a layer's 576 -> 576, 192, 1536 and 1536 -> 576 projections, and the 576 -> 49152
    LM head), one thread, in interleaved pairs: at most 0.35 of the time of x @ dequantize_int8(q, scale).T (a float
    copy of q, even unscaled, is 4 bytes a weight again). Example: x = [[2., -1.]], q = [[127, 127]], scale
    = [1/127] (w = [[1., 1.]]): x's codes [127, -64] with scale 2/127, integer product 127 * 127 - 64 * 127 = 8001,
    y = [[8001 * 2/127 * 1/127]] = [[0.99213]], and x @ w.T = [[1.]]: 0.0079 away, within (1/127) * 2 = 0.0157.
    """
    raise NotImplementedError("task 07.matvec: see the docstring; `minillm hint 07 matvec` for hints")
