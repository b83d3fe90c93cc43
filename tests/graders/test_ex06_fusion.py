"""Grader for exercise 06: fused q/k/v weights and their split; RMSNorm with the residual add folded in.

`check_qkv` compares the fused weight with the q, k, v rows in that order and the split with the three separate
projections, on MHA, GQA (SmolLM2's 9 query / 3 KV heads) and MQA shapes. `check_add_norm` compares with add then
rms_norm in float32 and bfloat16. The real-model task fuses SmolLM2 with your functions (swapped into
minillm.compile.fusion) and requires the unfused model's logits and greedy tokens. The `*_rejects_wrong_answers` tests
run the checks on common mistakes (skipped when grading exercises/).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import minillm
import minillm.compile.fusion
from minillm.model import rms_norm
from tests.graders.conftest import TARGET, forbid_calls, load_impl

impl = load_impl("ex06_fusion")
grader_selftest = pytest.mark.skipif(TARGET == "exercises", reason="checks the grader itself, not your code")

SHAPES = [(9, 3, 64), (4, 4, 16), (6, 1, 8), (8, 2, 32)]  # (n_heads, n_kv_heads, head_dim): GQA, MHA, MQA, GQA


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ==================================================================================================== task 06.qkv


def check_qkv(fuse_qkv_weights, split_qkv) -> None:
    for i, (h, hkv, d) in enumerate(SHAPES):
        g = _gen(i)
        dim = 48
        wq, wk, wv = (torch.randn(n * d, dim, generator=g) for n in (h, hkv, hkv))
        w = fuse_qkv_weights(wq, wk, wv)
        assert tuple(w.shape) == ((h + 2 * hkv) * d, dim), (
            f"n_heads={h}, n_kv_heads={hkv}, head_dim={d}: fused weight has shape {tuple(w.shape)}, expected "
            f"{((h + 2 * hkv) * d, dim)} (stack the rows: out features add up, in features stay)")
        assert torch.equal(w, torch.cat([wq, wk, wv])), (
            f"n_heads={h}, n_kv_heads={hkv}: the fused rows must be q's, then k's, then v's (in that order)")
        x = torch.randn(2, 5, dim, generator=g)
        q, k, v = split_qkv(F.linear(x, w), h, hkv, d)
        for name, got, want in (("q", q, F.linear(x, wq)), ("k", k, F.linear(x, wk)), ("v", v, F.linear(x, wv))):
            assert tuple(got.shape) == tuple(want.shape), (
                f"n_heads={h}, n_kv_heads={hkv}, head_dim={d}: {name} has shape {tuple(got.shape)}, expected "
                f"{tuple(want.shape)} (q is n_heads * head_dim wide, k and v n_kv_heads * head_dim each)")
            torch.testing.assert_close(got, want, msg=f"{name} differs from its own projection (n_heads={h}, "
                                                      f"n_kv_heads={hkv})")


@pytest.mark.task_06_qkv
def test_qkv_fusion_equals_separate_projections():
    check_qkv(impl.fuse_qkv_weights, impl.split_qkv)
    for fn in (impl.fuse_qkv_weights, impl.split_qkv):
        forbid_calls(fn, ["minillm", "fusion"])


# =============================================================================================== task 06.add_norm


def check_add_norm(add_rms_norm) -> None:
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        g = _gen(7)
        x, r = torch.randn(3, 6, 64, generator=g) * 20, torch.randn(3, 6, 64, generator=g) * 20
        w = torch.rand(64, generator=g) + 0.5
        x, r, w = x.to(dtype), r.to(dtype), w.to(dtype)
        out = add_rms_norm(x, r, w, 1e-5)
        assert isinstance(out, tuple) and len(out) == 2, "return (normalised sum, sum)"
        normed, h = out
        assert h.dtype == normed.dtype == dtype, f"{dtype} in, got {h.dtype}/{normed.dtype} out"
        torch.testing.assert_close(h, x + r, atol=tol, rtol=tol,
                                   msg=f"{dtype}: the second output is the sum x + residual")
        torch.testing.assert_close(normed, rms_norm(x + r, w, 1e-5), atol=tol, rtol=tol,
                                   msg=f"{dtype}: the first output is rms_norm(x + residual)")


@pytest.mark.task_06_add_norm
def test_add_norm_equals_add_then_norm():
    check_add_norm(impl.add_rms_norm)
    forbid_calls(impl.add_rms_norm, ["fusion", "layer_norm"])


# ========================================================================================= the real model, fused


@pytest.mark.task_06_real_model
def test_your_fusion_runs_smollm2(real_model, monkeypatch):
    """Your three functions fuse the real model: same logits (fp32) and the same greedy answer."""
    for name in ("fuse_qkv_weights", "split_qkv", "add_rms_norm"):
        monkeypatch.setattr(minillm.compile.fusion, name, getattr(impl, name))
    model, tok = real_model
    fused = minillm.compile.fusion.fuse(copy.deepcopy(model))
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    with torch.inference_mode():
        x = torch.tensor([ids])
        assert (fused(x) - model(x)).abs().max() <= 1e-4, "the fused model's logits differ from the unfused model's"
    out = minillm.generate(fused, tok, ids, max_new_tokens=12)
    assert out.text.strip() == "The capital of France is Paris.", f"the fused model answered {out.text!r}"


# ================================================================================================ grader self-test


def _wrong_order(wq, wk, wv):
    return torch.cat([wk, wq, wv])


def _wrong_split_order(qkv, n_heads, n_kv_heads, head_dim):
    k, q, v = qkv.split([n_kv_heads * head_dim, n_heads * head_dim, n_kv_heads * head_dim], dim=-1)
    return q, k, v


def _equal_thirds(qkv, n_heads, n_kv_heads, head_dim):
    return qkv.chunk(3, dim=-1)


def _residual_not_summed(x, residual, weight, eps):
    return rms_norm(x + residual, weight, eps), x


def _norm_before_add(x, residual, weight, eps):
    return rms_norm(x, weight, eps) + residual, x + residual


@grader_selftest
@pytest.mark.parametrize("fuse_fn, split_fn", [
    (_wrong_order, "ok"),  # consistent with a matching split, yet the fused layout is not q, k, v
    ("ok", _wrong_split_order),
    ("ok", _equal_thirds),  # right only when n_heads == n_kv_heads (MHA)
])
def test_qkv_rejects_wrong_answers(fuse_fn, split_fn):
    fuse_fn = minillm.compile.fusion.fuse_qkv_weights if fuse_fn == "ok" else fuse_fn
    split_fn = minillm.compile.fusion.split_qkv if split_fn == "ok" else split_fn
    with pytest.raises(AssertionError):
        check_qkv(fuse_fn, split_fn)


@grader_selftest
@pytest.mark.parametrize("fn", [_residual_not_summed, _norm_before_add])
def test_add_norm_rejects_wrong_answers(fn):
    with pytest.raises(AssertionError):
        check_add_norm(fn)
