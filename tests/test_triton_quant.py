"""The Triton int8 / int4 weight-only matmuls against dequantize-then-matmul in float64 (interpreter on CPU, or
CUDA)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if importlib.util.find_spec("triton") is None:  # not importorskip: importing triton first would fix its mode
    pytest.skip("triton is not installed (pip install triton)", allow_module_level=True)

from minillm_kernels.quant_matmul import INTERPRET, int4_group_matmul, int8_weight_matmul

DEVICE = "cpu" if INTERPRET else "cuda"
BLOCKS = [None, (16, 16, 16), (16, 32, 32)]  # None: the choice from M; the others force several N and K tiles


# ------------------------------------------------------------------------------------------- the oracle

def ref_int8(x, q, scale):
    return x.double() @ (q.double() * scale.double()[:, None]).T


def pack(codes):
    """uint8 codes (N, K) in [0, 15] -> (N, K // 2): column 2j in the low nibble, 2j+1 in the high one."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def ref_int4(x, packed, scale, minimum, group_size):
    codes = torch.empty(packed.shape[0], 2 * packed.shape[1], dtype=torch.float64)
    codes[:, 0::2] = (packed & 0x0F).double()
    codes[:, 1::2] = (packed >> 4).double()
    groups = torch.arange(codes.shape[1]) // group_size
    w = codes * scale.double()[:, groups] + minimum.double()[:, groups]
    return x.double() @ w.T


def check(y, ref, x_dtype):
    assert y.dtype == x_dtype and y.shape == ref.shape
    # relative to the largest output: sums of signed terms cancel, so small outputs carry the big ones' rounding.
    # bf16: the output is rounded (the interpreter truncates: up to 1 ulp = 2^-7) and on GPU so is each weight
    rel = 1e-5 if x_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.cpu().double(), ref, rtol=rel, atol=rel * max(ref.abs().max().item(), 1.0))


def run8(x, q, scale, **kw):
    return int8_weight_matmul(x.to(DEVICE), q.to(DEVICE), scale.to(DEVICE), **kw)


def run4(x, packed, scale, minimum, group_size, **kw):
    return int4_group_matmul(x.to(DEVICE), packed.to(DEVICE), scale.to(DEVICE), minimum.to(DEVICE), group_size, **kw)


def make_int4(n, k, group_size, gen, scale_dtype=torch.float16):
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // group_size, generator=gen) * 0.1).to(scale_dtype)
    minimum = (-torch.rand(n, k // group_size, generator=gen) * 0.8).to(scale_dtype)
    return codes, scale, minimum


# ------------------------------------------------------------------------------------------- property tests

shapes = {"m": st.sampled_from([1, 3, 17]), "n": st.sampled_from([16, 48, 40]),  # 40: not a multiple of a tile
          "k": st.sampled_from([64, 128, 192]), "dtype": st.sampled_from([torch.float32, torch.bfloat16]),
          "blocks": st.sampled_from(BLOCKS), "scale_dtype": st.sampled_from([torch.float32, torch.bfloat16,
                                                                             torch.float16]),
          "seed": st.integers(0, 2**16)}


@settings(max_examples=25, deadline=None)
@given(**shapes)
def test_int8_matches_dequantize_then_matmul(m, n, k, dtype, blocks, scale_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = (torch.randn(n, generator=gen) * 0.01).to(scale_dtype)  # some negative: the kernel must not assume > 0
    check(run8(x, q, scale, block_sizes=blocks), ref_int8(x, q, scale), dtype)


@settings(max_examples=25, deadline=None)
@given(group_size=st.sampled_from([32, 64]), **shapes)
def test_int4_matches_dequantize_then_matmul(m, n, k, group_size, dtype, blocks, scale_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    codes, scale, minimum = make_int4(n, k, group_size, gen, scale_dtype)
    packed = pack(codes)
    check(run4(x, packed, scale, minimum, group_size, block_sizes=blocks),
          ref_int4(x, packed, scale, minimum, group_size), dtype)


# ------------------------------------------------------------------------------------------- edge cases

def test_int8_extreme_codes_negative_and_zero_scales():
    gen = torch.Generator().manual_seed(1)
    n, k = 40, 80  # K = 80: no block size divides it, so the last K tile is ragged (masked)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    q[0], q[1], q[2, ::2] = -127, 127, -127
    scale = torch.randn(n, generator=gen) * 0.02
    scale[1], scale[3] = -0.5, 0.0
    x = torch.randn(5, k, generator=gen)
    y = run8(x, q, scale)
    check(y, ref_int8(x, q, scale), torch.float32)
    assert (y[:, 3] == 0).all()


def test_int4_constant_group_all_fifteen_and_negative_minimum():
    gen = torch.Generator().manual_seed(2)
    n, k, g = 40, 128, 32
    codes, scale, minimum = make_int4(n, k, g, gen)
    codes[0] = 0
    scale[0] = 0.0  # a constant group (max == min): scale 0, every weight equals the minimum
    minimum[0] = -0.25
    codes[1] = 15  # the high nibble at its largest: a signed shift would make it negative
    codes[2, 1::2] = 15
    codes[2, 0::2] = 0
    x = torch.randn(3, k, generator=gen)
    packed = pack(codes)
    y = run4(x, packed, scale, minimum, g)
    check(y, ref_int4(x, packed, scale, minimum, g), torch.float32)
    torch.testing.assert_close(y[:, 0].cpu(), -0.25 * x.sum(1), rtol=1e-5, atol=1e-5)


def test_int4_group_16_and_128():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 256, generator=gen)
    for g in (16, 128):
        codes, scale, minimum = make_int4(24, 256, g, gen)
        packed = pack(codes)
        check(run4(x, packed, scale, minimum, g), ref_int4(x, packed, scale, minimum, g), torch.float32)


def test_leading_dims_empty_batch_and_non_contiguous_x():
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(-127, 128, (16, 64), generator=gen, dtype=torch.int8)
    scale = torch.rand(16, generator=gen)
    codes, s4, m4 = make_int4(16, 64, 32, gen)
    packed = pack(codes)
    x = torch.randn(2, 3, 64, generator=gen)
    y8, y4 = run8(x, q, scale), run4(x, packed, s4, m4, 32)
    assert y8.shape == y4.shape == (2, 3, 16)
    check(y8.reshape(6, 16), ref_int8(x.reshape(6, 64), q, scale), torch.float32)
    check(y4.reshape(6, 16), ref_int4(x.reshape(6, 64), packed, s4, m4, 32), torch.float32)
    assert run8(torch.randn(0, 64), q, scale).shape == (0, 16)
    assert run4(torch.randn(2, 0, 64), packed, s4, m4, 32).shape == (2, 0, 16)
    xt = torch.randn(64, 5, generator=gen).to(DEVICE).T  # rows of x are not contiguous: strides go to the kernel
    assert not xt.is_contiguous()
    check(int8_weight_matmul(xt, q.to(DEVICE), scale.to(DEVICE)), ref_int8(xt.cpu(), q, scale), torch.float32)


def test_layouts_match_minillm_quant():
    # the layer code (minillm/compress/quant.py) quantizes and packs; the kernels must read exactly those layouts
    quant = pytest.importorskip("minillm.compress.quant")
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(48, 128, generator=gen), torch.randn(3, 128, generator=gen)
    q, scale = quant.quantize_int8(w)
    check(run8(x, q, scale), x.double() @ quant.dequantize_int8(q, scale).double().T, torch.float32)
    codes, s4, m4 = quant.quantize_int4(w, 32)
    w4 = quant.dequantize_int4(codes, s4, m4, 32).double()
    check(run4(x, quant.pack_int4(codes), s4, m4, 32), x.double() @ w4.T, torch.float32)


# ------------------------------------------------------------------------------------------- bad input

def test_bad_inputs_have_clear_errors():
    x, q, scale = torch.randn(2, 64), torch.zeros(16, 64, dtype=torch.int8), torch.ones(16)
    packed, s4 = torch.zeros(16, 32, dtype=torch.uint8), torch.ones(16, 2)
    with pytest.raises(TypeError, match="torch.Tensor"):
        int8_weight_matmul(None, q, scale)
    with pytest.raises(ValueError, match="x must be float32"):
        int8_weight_matmul(x.double(), q, scale)
    with pytest.raises(ValueError, match="q must be int8"):
        int8_weight_matmul(x, q.to(torch.uint8), scale)
    with pytest.raises(ValueError, match="2-d"):
        int8_weight_matmul(x, q[0], scale)
    with pytest.raises(ValueError, match=r"q.shape\[1\] = 64"):
        int8_weight_matmul(torch.randn(2, 32), q, scale)
    with pytest.raises(ValueError, match=r"scale must have shape \(16,\)"):
        int8_weight_matmul(x, q, torch.ones(16, 1))
    with pytest.raises(ValueError, match="scale must be float32"):
        int8_weight_matmul(x, q, torch.ones(16, dtype=torch.int32))
    with pytest.raises(ValueError, match="one device"):
        int8_weight_matmul(x, q, torch.ones(16, device="meta"))
    with pytest.raises(ValueError, match="powers of 2"):
        int8_weight_matmul(x, q, scale, block_sizes=(16, 16, 8))
    with pytest.raises(ValueError, match="qweight must be uint8"):
        int4_group_matmul(x, packed.to(torch.int8), s4, s4, 32)
    with pytest.raises(ValueError, match=r"2 \* qweight.shape\[1\] = 64"):
        int4_group_matmul(torch.randn(2, 32), packed, s4, s4, 32)
    with pytest.raises(ValueError, match="group_size must be a power of 2"):
        int4_group_matmul(x, packed, s4, s4, 24)  # not a power of 2
    with pytest.raises(ValueError, match="divides K=64"):
        int4_group_matmul(x, packed, torch.ones(16, 1), torch.ones(16, 1), 128)  # does not divide K
    with pytest.raises(ValueError, match=r"scale must have shape \(N, K // group_size\) = \(16, 2\)"):
        int4_group_matmul(x, packed, torch.ones(16, 4), s4, 32)
    with pytest.raises(ValueError, match="minimum must have shape"):
        int4_group_matmul(x, packed, s4, torch.ones(2, 16), 32)
    with pytest.raises(ValueError, match="minimum must be float32"):
        int4_group_matmul(x, packed, s4, s4.to(torch.uint8), 32)
    with pytest.raises(ValueError, match="one device"):
        int4_group_matmul(x, packed, s4, s4.to("meta"), 32)
    with pytest.raises(ValueError, match="must divide group_size"):
        int4_group_matmul(x, packed, s4, s4, 32, block_sizes=(16, 16, 64))


@pytest.mark.skipif(INTERPRET, reason="only a GPU build rejects CPU tensors")
def test_cpu_tensors_rejected_on_gpu_build():
    with pytest.raises(ValueError, match="CUDA"):
        int8_weight_matmul(torch.randn(2, 64), torch.zeros(16, 64, dtype=torch.int8), torch.ones(16))


# ------------------------------------------------------------------------------------------- CUDA

MODEL_SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]  # (N, K): attention, MLP up/down, LM head


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")
@pytest.mark.parametrize("m", [1, 64])
@pytest.mark.parametrize("nk", MODEL_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_cuda_model_shapes_bf16(nk, m):
    n, k = nk
    gen = torch.Generator().manual_seed(n + k + m)
    x = torch.randn(m, k, generator=gen).bfloat16()
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = (torch.rand(n, generator=gen) * 0.01).bfloat16()
    check(run8(x, q, scale), ref_int8(x, q, scale), torch.bfloat16)
    for g in (32, 64, 128):
        if k % g:  # 128 does not divide 576
            continue
        codes, s4, m4 = make_int4(n, k, g, gen)
        packed = pack(codes)
        check(run4(x, packed, s4, m4, g), ref_int4(x, packed, s4, m4, g), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_other_dtypes(dtype):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(7, 576, generator=gen).to(dtype)
    q = torch.randint(-127, 128, (1536, 576), generator=gen, dtype=torch.int8)
    scale = torch.rand(1536, generator=gen) * 0.01
    check(run8(x, q, scale), ref_int8(x, q, scale), dtype)
    codes, s4, m4 = make_int4(1536, 576, 64, gen)
    check(run4(x, pack(codes), s4, m4, 64), ref_int4(x, pack(codes), s4, m4, 64), dtype)
