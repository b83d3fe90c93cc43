"""The Triton flash kernel against torch SDPA: under the interpreter on CPU (small shapes), on CUDA when present."""

from __future__ import annotations

import pytest
import torch

from minillm.attention import sdpa_attention

fa = pytest.importorskip("minillm_kernels.flash_attn", reason="triton is not installed (pip install -e '.[kernels]')")
triton_attention = fa.triton_attention

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.float16: {"atol": 2e-3, "rtol": 2e-3},
       # the interpreter truncates fp32 -> bf16 instead of rounding: up to 2 bf16 ulps off
       torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}
DEVICE = "cuda" if torch.cuda.is_available() and not fa.INTERPRET else "cpu"


def make_qkv(batch, n_heads, n_kv_heads, q_len, kv_len, head_dim, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, n_heads, q_len, head_dim), (batch, n_kv_heads, kv_len, head_dim),
              (batch, n_kv_heads, kv_len, head_dim)]
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in shapes]


def check(q, k, v, causal):
    out = triton_attention(q, k, v, causal=causal)
    ref = sdpa_attention(q.float(), k.float(), v.float(), causal=causal).to(q.dtype)  # fp32 math oracle
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, **TOL[q.dtype])


# (batch, n_heads, n_kv_heads, q_len, kv_len, head_dim): ragged ends, decode, chunked prefill, GQA, MHA, MQA
INTERPRETER_CASES = [
    (1, 2, 1, 16, 16, 16),
    (2, 4, 2, 50, 50, 32),
    (1, 3, 3, 1, 100, 64),  # decode: one query over a long cache
    (1, 6, 2, 33, 128, 16),  # chunked prefill: the queries are the last 33 of 128 positions
    (1, 4, 1, 100, 100, 64),  # MQA, kv_len not a multiple of the 64-key tile
    (1, 2, 2, 128, 128, 32),
]


@pytest.mark.skipif(not fa.INTERPRET, reason="interpreter cases (the CUDA cases cover a GPU machine)")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=lambda c: "x".join(map(str, c)))
def test_interpreter_float32(case, causal):
    check(*make_qkv(*case), causal)


@pytest.mark.skipif(not fa.INTERPRET, reason="interpreter cases")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_interpreter_low_precision(dtype):
    check(*make_qkv(1, 4, 2, 70, 90, 32, dtype=dtype), causal=True)


@pytest.mark.skipif(not fa.INTERPRET, reason="interpreter cases")
def test_interpreter_non_contiguous_inputs():
    # the model hands over views: (b, s, h, d) memory read as (b, h, s, d)
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in make_qkv(1, 4, 2, 40, 40, 16))
    assert not q.is_contiguous()
    check(q, k, v, causal=True)


@pytest.mark.skipif(not fa.INTERPRET, reason="interpreter cases")
def test_interpreter_tiles_above_diagonal_are_skipped():
    # keys a query may not see are poisoned with NaN; a kernel that loads/uses them (even masked-to-zero after
    # a multiply) would return NaN. Tile-level skipping is what keeps the poison out of every tile.
    q, k, v = make_qkv(1, 2, 1, 128, 128, 16)
    v_poisoned = v.clone()
    v_poisoned[:, :, 64:] = float("nan")
    out = triton_attention(q[:, :, :64], k[:, :, :64], v[:, :, :64], causal=True)
    full = triton_attention(q, k, v_poisoned, causal=True)
    torch.testing.assert_close(full[:, :, :64], out, atol=1e-6, rtol=1e-6)


def logits_with(model, backend, ids):
    saved = model.attn_backend
    try:
        model.attn_backend = backend
        with torch.no_grad():
            return model(ids)
    finally:
        model.attn_backend = saved


@pytest.mark.skipif(not fa.INTERPRET, reason="interpreter cases")
def test_tiny_model_triton_backend_matches_sdpa():
    from minillm.config import ModelConfig
    from minillm.model import Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(n_heads=4, n_kv_heads=2, dim=64))  # head_dim 16
    ids = torch.randint(0, 512, (2, 45))
    torch.testing.assert_close(logits_with(model, "triton", ids), logits_with(model, "sdpa", ids),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.skipif(not fa.INTERPRET, reason="interpreter cases")
def test_real_model_triton_backend_matches_sdpa(real_model):
    # ~20-30 s under the interpreter: 30 layers x 9 heads of interpreted programs
    model, _ = real_model
    ids = torch.randint(17, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(logits_with(model, "triton", ids), logits_with(model, "sdpa", ids),
                               atol=2e-3, rtol=1e-3)


# ------------------------------------------------------------------------------------------- bad input


def test_bad_input_raises_clear_errors():
    q, k, v = make_qkv(1, 2, 1, 8, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim 24"):
        triton_attention(*make_qkv(1, 2, 1, 8, 8, 24, device=DEVICE))
    with pytest.raises(TypeError, match="one dtype"):
        triton_attention(q, k.half(), v)
    with pytest.raises(TypeError, match="not supported"):
        triton_attention(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="must divide"):
        triton_attention(torch.cat([q, q[:, :1]], 1), torch.cat([k, k], 1), torch.cat([v, v], 1))
    with pytest.raises(ValueError, match="q_len"):
        triton_attention(q, k[:, :, :4], v[:, :, :4])
    with pytest.raises(TypeError, match="torch.Tensor"):
        triton_attention(None, k, v)


def test_empty_batch_returns_empty():
    q, k, v = make_qkv(0, 2, 1, 8, 8, 16, device=DEVICE)
    assert triton_attention(q, k, v).shape == (0, 2, 8, 16)


@pytest.mark.skipif(fa.INTERPRET, reason="only a GPU build rejects CPU tensors")
def test_cpu_tensors_rejected_on_gpu_build():
    with pytest.raises(ValueError, match="CUDA"):
        triton_attention(*make_qkv(1, 2, 1, 8, 8, 16))


# ------------------------------------------------------------------------------------------- CUDA

CUDA_CASES = [  # (batch, n_heads, n_kv_heads, q_len, kv_len, head_dim)
    (2, 16, 16, 1024, 1024, 64),
    (1, 9, 3, 1000, 1000, 64),  # SmolLM2's heads, ragged length
    (2, 8, 2, 1, 4097, 128),  # decode over a long cache
    (1, 8, 4, 300, 2048, 32),  # chunked prefill
    (4, 4, 1, 513, 513, 16),
]


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", CUDA_CASES, ids=lambda c: "x".join(map(str, c)))
def test_cuda(case, causal, dtype):
    q, k, v = make_qkv(*case, dtype=dtype, device="cuda")
    out = triton_attention(q, k, v, causal=causal)
    ref = sdpa_attention(q.float(), k.float(), v.float(), causal=causal).to(dtype)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else TOL[dtype] if dtype == torch.float16 \
        else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(out, ref, **tol)


# ------------------------------------------------------------------------------------------- exercise sync


def test_exercise_solution_is_the_kernels_inner_step():
    # tests/test_exercise_sync.py cannot read a @triton.jit function's source; compare from the `def` line on
    import inspect
    import textwrap

    from solutions.ex03_flash import attend_key_block

    def body(jitted):
        src = textwrap.dedent(inspect.getsource(jitted.fn))
        return src[src.index("def "):]

    assert body(attend_key_block) == body(fa.attend_key_block), (
        "solutions/ex03_flash.py:attend_key_block drifted from minillm_kernels.flash_attn.attend_key_block")
