"""Quantization (lesson 07): formats against float oracles, the file's own Q4_1 bytes, LLM.int8(), int8 KV caches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from minillm.config import ModelConfig
from minillm.kv_cache import Int8KVCache, KVCache
from minillm.compress.llm_int8 import LLMInt8Linear, int8_matmul_with_outliers, int8_matvec
from minillm.model import Transformer, model_bytes
from minillm.compress.quant import (Int4Linear, Int8Linear, dequantize_int4, dequantize_int8, fake_quantize_int4,
                                    pack_int4, quantize_int4, quantize_int8, unpack_int4)
from minillm.compress.quantize import quantize

TINY = ModelConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)


def tiny_model(dtype=torch.float32, seed=0) -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(TINY).eval().requires_grad_(False)
    for p in m.parameters():
        p.data.normal_(0, 0.2)
    return m.to(dtype)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(1, 40), scale=st.sampled_from([1e-6, 1.0, 300.0]),
       seed=st.integers(0, 2**16))
def test_int8_round_trip_error_is_half_a_step(rows, cols, scale, seed):
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * scale
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.min()) >= -127
    assert torch.equal(q.abs().amax(1), torch.full((rows,), 127, dtype=torch.int8))  # each row's max uses the range
    assert ((dequantize_int8(q, s) - w).abs() <= s[:, None] / 2 * (1 + 1e-5)).all()


def test_int8_zero_row_and_symmetry():
    w = torch.tensor([[0.0, 0.0, 0.0], [-2.0, 1.0, 2.0]])
    q, s = quantize_int8(w)
    assert torch.isfinite(s).all() and torch.equal(dequantize_int8(q, s)[0], torch.zeros(3))
    assert q[1].tolist() == [-127, 64, 127]


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 5), groups=st.integers(1, 4), g=st.sampled_from([2, 8, 32]), seed=st.integers(0, 2**16))
def test_int4_codes_match_gguf_q4_1(rows, groups, g, seed):
    """The same rule as the gguf package's Q4_1 quantizer (its own implementation, an independent oracle)."""
    from gguf.quants import Q4_1

    w = torch.randn(rows, groups * 32, generator=torch.Generator().manual_seed(seed))
    codes, scale, minimum = quantize_int4(w, 32)
    blocks = Q4_1.quantize_blocks(w.numpy().reshape(-1, 32))
    np.testing.assert_array_equal(scale.numpy().reshape(-1), blocks[:, 0:2].copy().view(np.float16).reshape(-1))
    np.testing.assert_array_equal(minimum.numpy().reshape(-1), blocks[:, 2:4].copy().view(np.float16).reshape(-1))
    qs = blocks[:, 4:]
    ref = np.concatenate([qs & 15, qs >> 4], axis=1).reshape(rows, -1)
    np.testing.assert_array_equal(codes.numpy(), ref)
    # any even group size: error within half a step (plus the fp16 rounding of scale and minimum)
    w2 = torch.randn(rows, groups * g, generator=torch.Generator().manual_seed(seed + 1))
    c, s, m = quantize_int4(w2, g)
    err = (dequantize_int4(c, s, m, g) - w2).abs().reshape(rows, groups, g)
    assert (err <= s.float()[..., None] * 0.5 + 2e-3 * w2.abs().max()).all()


def test_int4_constant_group_and_packing():
    w = torch.full((2, 32), -0.0)
    w[1] = 3.5
    codes, scale, minimum = quantize_int4(w, 32)
    assert codes.eq(0).all() and scale.eq(0).all()
    assert torch.equal(dequantize_int4(codes, scale, minimum, 32), w.abs().copysign(torch.ones(1)) * (w != 0))
    everything = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_int4(unpack_int4(everything)), everything)
    assert unpack_int4(torch.tensor([0x21], dtype=torch.uint8)).tolist() == [1, 2]  # column 0 in the low nibble
    with pytest.raises(ValueError, match="even"):
        pack_int4(torch.zeros(3, dtype=torch.uint8))


@pytest.mark.parametrize("scheme,kw,tol", [("int8", {}, 0.03), ("int4", {"group_size": 16}, 0.25),
                                           ("llm.int8", {}, 0.03)])
def test_quantized_model_tracks_the_float_model(scheme, kw, tol):
    ref, m = tiny_model(), tiny_model()
    before = model_bytes(m)
    quantize(m, scheme, **kw)
    assert not any(type(x) is nn.Linear for x in m.modules())
    assert model_bytes(m) < before / (3 if scheme != "int4" else 5)
    ids = torch.randint(0, TINY.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want, got = ref(ids), m(ids)
    rel = (got - want).norm() / want.norm()
    assert rel < tol, f"{scheme}: relative logit error {rel:.3f}"
    # the embedding reads the quantized head's rows: tied storage stays one storage
    head = m.lm_head
    torch.testing.assert_close(m.embed(ids[:1, :3])[0], head.dequantize()[ids[0, :3]].to(m.dtype))


@pytest.fixture
def torch_kernels_only(monkeypatch):
    """The layers' torch path (what runs where minillm's CPU kernels cannot build); tests/test_cpu_kernels.py
    covers ours."""
    from minillm.compress import quant

    monkeypatch.setattr(quant, "cpu_kernels", lambda: None)


def test_int4_cpu_kernel_equals_dequantized_matmul(torch_kernels_only):
    lin = nn.Linear(64, 48, bias=False)
    q = Int4Linear.from_linear(lin, 32)
    x = torch.randn(3, 5, 64)
    want = F.linear(x.bfloat16().float(), q.dequantize())  # torch's kernel runs in bf16
    torch.testing.assert_close(q(x), want, atol=0.05, rtol=0.02)
    odd = Int4Linear.from_linear(nn.Linear(64, 40, bias=False), 32)  # 40 rows: not the kernel's 16-row packs
    torch.testing.assert_close(odd(x), F.linear(x, odd.dequantize()))


def test_int8_linear_matches_and_keeps_its_scales_through_casts(torch_kernels_only):
    lin = nn.Linear(64, 32, bias=False)
    q = Int8Linear.from_linear(lin)
    scale = q.scale.clone()
    q.to(torch.bfloat16)
    assert q.scale.dtype == torch.float32 and torch.equal(q.scale, scale)
    x = torch.randn(4, 64)
    torch.testing.assert_close(q(x), F.linear(x.bfloat16().float(), dequantize_int8(q.weight, q.scale)),
                               atol=0.05, rtol=0.02)


def test_llm_int8_decomposition_rescues_outlier_columns():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=g)
    q, s = quantize_int8(w)
    x = torch.randn(5, 64, generator=g)
    x[:, 3] = 900.0
    x[2, 10] = -60.0
    want = x @ dequantize_int8(q, s).T
    y, mask = int8_matmul_with_outliers(x, q, s, threshold=6.0)
    assert mask.nonzero().flatten().tolist() == [3, 10]
    y_plain, _ = int8_matmul_with_outliers(x, q, s, threshold=1e9)  # no decomposition
    err, err_plain = (y - want).norm() / want.norm(), (y_plain - want).norm() / want.norm()
    assert err < 0.01 and err_plain > 5 * err
    layer = LLMInt8Linear(q, s)
    layer.outlier_counts = []
    torch.testing.assert_close(layer(x), y)
    assert layer.outlier_counts == [2]


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 8), n_in=st.integers(1, 300), n_out=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_int8_matvec_is_within_half_an_activation_step_per_column(rows, n_in, n_out, seed):
    g = torch.Generator().manual_seed(seed)
    q, s = quantize_int8(torch.randn(n_out, n_in, generator=g))
    x = torch.randn(rows, n_in, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    x[0] = 0  # a row of zeros: exactly zero out
    wd = dequantize_int8(q, s).double()
    y = int8_matvec(x, q, s)
    assert y.dtype == torch.float32 and y.shape == (rows, n_out) and not y[0].any()
    step = x.abs().amax(1).double() / 127  # each row's int8 step; an error of at most half of it per column
    bound = step[:, None] / 2 * wd.abs().sum(1)[None, :] * (1 + 1e-5) + 1e-6 * (x.double().abs() @ wd.abs().T)
    assert ((y.double() - x.double() @ wd.T).abs() <= bound).all()
    same, _ = int8_matmul_with_outliers(x, q, s, threshold=float("inf"))  # no outliers: the same integer product
    assert torch.equal(y, same)
    with pytest.raises(ValueError, match="int8"):
        int8_matvec(x, q.float(), s)
    with pytest.raises(ValueError, match="rows, in"):
        int8_matvec(x[:, :-1] if n_in > 1 else x[:, :0], q, s)


def test_bad_input_errors_name_the_choices():
    m = tiny_model()
    with pytest.raises(ValueError, match="int8"):
        quantize(m, "int3")
    with pytest.raises(ValueError, match="divide"):
        quantize(m, "int4", group_size=48)
    quantize(m, "int8")
    with pytest.raises(ValueError, match="already quantized"):
        quantize(m, "int8")
    with pytest.raises(TypeError, match="float"):
        m.load_state_dict(tiny_model().state_dict(), strict=False)
    with pytest.raises(ValueError, match="threshold"):
        LLMInt8Linear.from_linear(nn.Linear(8, 8, bias=False), threshold=0)


def test_fake_quantize_3_bit_is_worse_than_4_bit():
    ref = tiny_model()
    ids = torch.randint(0, TINY.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    errs = []
    for bits in (4, 3):
        m = fake_quantize_int4(tiny_model(), 16, bits)
        errs.append(float((m(ids) - ref(ids)).norm()))
    assert errs[0] < errs[1]


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_int8_kv_cache_decodes_close_to_the_float_cache(cache):
    from minillm.api import make_cache

    m = tiny_model()
    ids = torch.randint(0, TINY.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2))
    outs = []
    for kv_dtype in (None, torch.int8):
        c = make_cache(cache, m, 32, kv_dtype=kv_dtype)
        with torch.inference_mode():
            steps = [m(ids[:, :8], kv_cache=c)] + [m(ids[:, t:t + 1], kv_cache=c) for t in range(8, 20)]
        outs.append(torch.cat(steps, dim=1))
    rel = (outs[1] - outs[0]).norm() / outs[0].norm()
    assert 0 < rel < 0.02
    with pytest.raises(ValueError, match="int8"):
        KVCache(TINY, 1, 8, kv_dtype=torch.float16)
    with pytest.raises(ValueError, match="int8"):
        KVCache(TINY, 1, 8, kv_dtype=torch.int8)  # int8 storage is its own class: Int8KVCache


def test_int8_kv_cache_holds_about_twice_the_tokens():
    from minillm.cache.kv_pool import KVCacheSpec

    fp = KVCacheSpec(30, 3, 64, 1, 16, torch.bfloat16).bytes_per_block()
    i8 = KVCacheSpec(30, 3, 64, 1, 16, torch.bfloat16, torch.int8).bytes_per_block()
    assert fp / i8 > 1.9
    assert Int8KVCache(TINY, 1, 8).nbytes() < KVCache(TINY, 1, 8, torch.bfloat16).nbytes() * 0.6


@pytest.mark.slow
def test_native_q4_model_is_the_files_bytes():
    """weights="q4": every Q4_1 layer dequantizes to exactly the fp32 model's weight (same file, nothing rounded)."""
    from minillm.api import load_model

    q4, _ = load_model(weights="q4")
    fp, _ = load_model()
    names = [n for n, x in q4.named_modules() if isinstance(x, Int4Linear)]
    assert len(names) == 210
    for n in names:
        assert torch.equal(q4.get_submodule(n).dequantize(), fp.get_submodule(n).weight), n


def test_awq_keeps_the_float_model_and_beats_round_to_nearest():
    from minillm.compress.awq import apply_awq

    ref = tiny_model(seed=3)
    for block in ref.layers:  # give some input channels large activations, as real models have
        block.attn_norm.weight[:4] *= 25
        block.mlp_norm.weight[:4] *= 25
    calib = torch.randint(0, TINY.vocab_size, (96,), generator=torch.Generator().manual_seed(4)).tolist()
    ids = torch.randint(0, TINY.vocab_size, (1, 24), generator=torch.Generator().manual_seed(5))
    awq = Transformer(TINY).eval().requires_grad_(False)
    awq.load_state_dict(ref.state_dict())
    report = apply_awq(awq, calib, group_size=16, bits=3, grid=10, window=32)
    torch.testing.assert_close(awq(ids), ref(ids), atol=1e-4, rtol=1e-4)  # scaling alone changes nothing
    assert len(report) == 3 * TINY.n_layers and all(r["gain"] >= 1 for r in report)
    rtn = Transformer(TINY).eval().requires_grad_(False)
    rtn.load_state_dict(ref.state_dict())
    want = ref(ids)
    err = {name: float((fake_quantize_int4(m, 16, 3)(ids) - want).norm()) for name, m in (("rtn", rtn), ("awq", awq))}
    assert err["awq"] < err["rtn"], err
    quantize(awq, "int8")
    with pytest.raises(ValueError, match="before quantize"):
        apply_awq(awq, calib, group_size=16)


def test_importing_minillm_leaves_dynamo_unloaded_and_the_kernel_check_constant():
    """`import minillm` must not pull in torch._dynamo (~150 MiB, ~2 s: lesson 14's edge profile), and the CPU-kernel
    check must still be marked the way torch.compiler.assume_constant_result marks a function."""
    import subprocess
    import sys

    code = "import sys, minillm; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
    import torch

    from minillm.compress.quant import _cpu_kernels_loaded

    marked = torch.compiler.assume_constant_result(lambda: True)
    assert {k for k in vars(marked)} == {"_dynamo_marked_constant"}
    assert _cpu_kernels_loaded._dynamo_marked_constant is marked._dynamo_marked_constant
