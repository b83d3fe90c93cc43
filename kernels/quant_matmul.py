"""Weight-only quantized matmul in Triton: y = x @ w.T with w stored as int8 or packed int4 (lesson 07).

Decode at batch 1 is memory-bound: each token multiplies a (1, K) activation by every weight matrix once, so the
speed is set by the bytes of weight read per token. int8 halves those bytes and int4 quarters them, but only if the
matmul reads the small integers themselves: dequantizing to a bf16 matrix first would write and re-read the full-size
weight. These kernels turn a tile of codes into floats in registers and feed it to tl.dot; only the quantized bytes
(plus the small scale tables) cross memory. Formats: `int8_weight_matmul`, `int4_group_matmul`; tiling: `_launch`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._triton_env import INTERPRET, tl, triton

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _int8_matmul_kernel(X, Q, S, Y, M, N, K, stride_xm, stride_xk, stride_qn, stride_qk, stride_s, stride_ym,
                        UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # N * K can pass 2^31 bytes
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)  # (BLOCK_M, BLOCK_K)
        if UPCAST:
            x = x.to(tl.float32)
        q = tl.load(Q + offs_n[:, None] * stride_qn + offs_k[None, :] * stride_qk, mask=n_ok[:, None] & k_ok[None, :],
                    other=0)  # (BLOCK_N, BLOCK_K) int8: the only weight bytes read
        acc = tl.dot(x, tl.trans(q.to(x.dtype)), acc, input_precision="ieee")  # |q| <= 127: exact in bf16/fp16
    scale = tl.load(S + offs_n * stride_s, mask=n_ok, other=0.0).to(tl.float32)
    y = acc * scale[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _int4_matmul_kernel(X, QW, S, MN, Y, M, N, K, stride_xm, stride_xk, stride_qn, stride_qb, stride_sn, stride_sg,
                        stride_mn, stride_mg, stride_ym, GROUP: tl.constexpr,
                        UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 (BLOCK_K divides the group size): no K masks
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=m_ok[:, None], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(QW + offs_n[:, None] * stride_qn + offs_b[None, :] * stride_qb, mask=n_ok[:, None],
                         other=0)  # (BLOCK_N, BLOCK_K // 2) uint8: two weights per byte read
        # column 2j is the low nibble of byte j, 2j+1 the high one: interleaving puts them back in column order
        codes = tl.interleave(packed & 0xF, packed >> 4).to(tl.float32)  # (BLOCK_N, BLOCK_K)
        group = k0 // GROUP  # the whole tile lies in this group
        d = tl.load(S + offs_n * stride_sn + group * stride_sg, mask=n_ok, other=0.0).to(tl.float32)
        m = tl.load(MN + offs_n * stride_mn + group * stride_mg, mask=n_ok, other=0.0).to(tl.float32)
        w = codes * d[:, None] + m[:, None]  # GGUF Q4_1, in registers
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision="ieee")
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _pick_blocks(m: int, n: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): BLOCK_M covers a decode batch in one 16-row tile; BLOCK_N is the largest of 64/32/16 that
    still gives every SM a program (a 576-wide layer at batch 1 has only 9 tiles of 64). The interpreter counts as one
    SM: fewer, bigger programs run faster there."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    n_sm = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    for block_n in (64, 32):
        if triton.cdiv(m, block_m) * triton.cdiv(n, block_n) >= n_sm:
            return block_m, block_n
    return block_m, 16


def _check_common(name: str, x: Tensor, weight: Tensor, tables: dict[str, Tensor]) -> None:
    for arg, t in {"x": x, name: weight, **tables}.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be float32, bfloat16 or float16, got {x.dtype}: cast it with x.to(torch.bfloat16)")
    if x.dim() < 1:
        raise ValueError("x must have a last dimension K (shape (..., K))")
    if weight.dim() != 2:
        raise ValueError(f"{name} must be 2-d (N, ...), got shape {tuple(weight.shape)}")
    for arg, t in tables.items():
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{arg} must be float32, bfloat16 or float16, got {t.dtype}")
    devices = {str(t.device) for t in (x, weight, *tables.values())}
    if len(devices) != 1:
        raise ValueError(f"x, {name} and {'/'.join(tables)} must be on one device, got {sorted(devices)}: move them "
                         f"with .to(x.device)")
    if not INTERPRET and x.device.type != "cuda":
        raise ValueError(f"the quantized matmul kernels run on CUDA tensors, got {x.device}: move them with .cuda(), "
                         f"or set TRITON_INTERPRET=1 before importing minillm_kernels to run them on the CPU")


def _check_blocks(block_sizes: tuple[int, int, int]) -> None:
    if len(block_sizes) != 3 or not all(isinstance(b, int) and b >= 16 and _is_pow2(b) for b in block_sizes):
        raise ValueError(f"block_sizes must be (BLOCK_M, BLOCK_N, BLOCK_K), powers of 2 >= 16, got {block_sizes}")


def _launch(kernel, x: Tensor, n: int, weights: tuple[Tensor, ...], strides: tuple[int, ...], block_sizes,
            default_block_k: int, **meta) -> Tensor:
    """Run one of the kernels on x (..., K) in float32 / bfloat16 / float16 -> y (..., N) in x's dtype.

    The sums accumulate in fp32. Grid: one program per (BLOCK_M rows of x, BLOCK_N outputs), looping over K. Block
    sizes are picked from M by `_pick_blocks` (no autotune: it needs a driver): a decode-sized M gets BLOCK_M = 16
    (the smallest tl.dot tile; rows past M are masked) and BLOCK_N small enough that the programs fill every SM, since
    with one token there is little other parallelism. Precision: on GPU the dot runs in x's dtype (bf16/fp16 tensor
    cores, fp32 accumulation; the dequantized int4 weight is rounded to that dtype, as a bf16 model's weights are),
    fp32 inputs in plain fp32 (input_precision="ieee", not TF32). Under the Triton interpreter (CPU,
    TRITON_INTERPRET=1, see _triton_env.py) everything is upcast to fp32 after loading (UPCAST), because the
    interpreter's bf16 arithmetic is wrong.
    """
    k = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), k)  # a view when it can be: strides go to the kernel, no copy
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        block_m, block_n, block_k = block_sizes or (*_pick_blocks(m, n, x.device), default_block_k)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        kernel[grid](x2, *weights, y, m, n, k, x2.stride(0), x2.stride(1), *strides, y.stride(0),
                     UPCAST=INTERPRET or x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n,
                     BLOCK_K=block_k, **meta)
    return y.reshape(*lead, n)


def int8_weight_matmul(x: Tensor, q: Tensor, scale: Tensor, *,
                       block_sizes: tuple[int, int, int] | None = None) -> Tensor:
    """x (..., K) @ (q * scale[:, None]).T -> (..., N) in x's dtype; q int8 (N, K), scale (N,) float.

    Symmetric per output channel: w[n, k] = q[n, k] * scale[n]. The scale is constant along K, so it factors out of
    the dot product: the kernel multiplies the raw codes (exact in bf16/fp16) by x and scales each output column once
    at the end. BLOCK_K is the largest of 128/64/32 that divides K (no ragged last tile; else 64, masked).
    block_sizes (BLOCK_M, BLOCK_N, BLOCK_K) overrides the choice from M (tests use it to force several tiles)."""
    _check_common("q", x, q, {"scale": scale})
    if q.dtype != torch.int8:
        raise ValueError(f"q must be int8 (N, K), got {q.dtype}: quantize the weight first (round(w / scale), "
                         f"clamped to [-127, 127])")
    n, k = q.shape
    if x.shape[-1] != k:
        raise ValueError(f"x's last dim {x.shape[-1]} != q.shape[1] = {k} (q is (out_features, in_features))")
    if scale.shape != (n,):
        raise ValueError(f"scale must have shape ({n},), one per output channel (row of q), got {tuple(scale.shape)}")
    if block_sizes is not None:
        _check_blocks(block_sizes)
    block_k = next((b for b in (128, 64, 32) if k % b == 0), 64)  # a divisor of K leaves no ragged last tile
    return _launch(_int8_matmul_kernel, x, n, (q, scale), (*q.stride(), scale.stride(0)), block_sizes, block_k)


def int4_group_matmul(x: Tensor, qweight: Tensor, scale: Tensor, minimum: Tensor, group_size: int, *,
                      block_sizes: tuple[int, int, int] | None = None) -> Tensor:
    """x (..., K) @ w.T -> (..., N) in x's dtype, w = code * scale + minimum per group of `group_size` columns.

    qweight uint8 (N, K // 2): byte j of row n holds column 2j in its low nibble and 2j+1 in its high nibble.
    scale, minimum (N, K // group_size): w[n, k] = code[n, k] * scale[n, k // g] + minimum[n, k // g] (GGUF Q4_1:
    d * q + m). A K tile never crosses a group (BLOCK_K divides group_size; default min(group_size, 128)), so one
    (scale, minimum) pair per row dequantizes the whole tile: unpack both nibbles, interleave them back into column
    order, code * d + m.
    block_sizes (BLOCK_M, BLOCK_N, BLOCK_K): BLOCK_K must divide group_size (a tile reads one group's scale)."""
    _check_common("qweight", x, qweight, {"scale": scale, "minimum": minimum})
    if qweight.dtype != torch.uint8:
        raise ValueError(f"qweight must be uint8 (N, K // 2) with two 4-bit codes per byte, got {qweight.dtype}: "
                         f"pack the codes first (low nibble = column 2j, high nibble = column 2j+1)")
    n, half_k = qweight.shape
    k = x.shape[-1]
    if k != 2 * half_k:
        raise ValueError(f"x's last dim {k} != 2 * qweight.shape[1] = {2 * half_k} (qweight packs two columns "
                         f"per byte)")
    if not isinstance(group_size, int) or group_size < 16 or not _is_pow2(group_size) or k % group_size:
        raise ValueError(f"group_size must be a power of 2 >= 16 that divides K={k}, got {group_size}; try one of "
                         f"{[g for g in (32, 64, 128) if k % g == 0]}")
    for arg, t in (("scale", scale), ("minimum", minimum)):
        if t.shape != (n, k // group_size):
            raise ValueError(f"{arg} must have shape (N, K // group_size) = ({n}, {k // group_size}), one per group "
                             f"of {group_size} columns, got {tuple(t.shape)}")
    if block_sizes is not None:
        _check_blocks(block_sizes)
        if group_size % block_sizes[2]:
            raise ValueError(f"BLOCK_K={block_sizes[2]} must divide group_size={group_size}: a K tile reads the "
                             f"scale of a single group")
    return _launch(_int4_matmul_kernel, x, n, (qweight, scale, minimum),
                   (*qweight.stride(), *scale.stride(), *minimum.stride()), block_sizes, min(group_size, 128),
                   GROUP=group_size)
