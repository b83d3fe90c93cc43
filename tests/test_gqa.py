"""MHA / GQA / MQA conversions of a loaded model, and grouped attention.

Oracles: torch SDPA (with K/V repeated per query head), the original model's logits (a lossless conversion must
reproduce them), a per-head loop for mean-pooling, and the KV-size formula.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.attention import repeat_kv
from minillm.api import generate_ids
from minillm.compress.gqa import (
    grouped_attention,
    kv_heads_for,
    mean_pool_kv_heads,
    regroup,
    repeat_kv_heads,
    to_mha,
    to_mqa,
    valid_kv_heads,
)
from minillm.kv_cache import KVCache, kv_bytes_per_token
from minillm.model import apply_rope, rope_tables
from minillm.sampling import SamplingParams
from tests.conftest import tiny_model

# ------------------------------------------------------------------------------------------- head mapping, attention


@given(data=st.data(), n_heads=st.sampled_from([1, 2, 4, 6, 9, 12]))
def test_kv_heads_for_agrees_with_repeat_kv(data, n_heads):
    n_kv = data.draw(st.sampled_from(valid_kv_heads(n_heads)))
    k = torch.arange(n_kv).float().reshape(1, n_kv, 1, 1)
    repeated = repeat_kv(k, n_heads // n_kv)  # (1, n_heads, 1, 1): which KV head each query head reads
    for h in range(n_heads):
        assert kv_heads_for(h, n_heads, n_kv) == int(repeated[0, h, 0, 0])


def test_kv_heads_for_examples_and_errors():
    assert [kv_heads_for(h, 9, 3) for h in range(9)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # adjacent heads, not h % 3
    assert [kv_heads_for(h, 9, 1) for h in range(9)] == [0] * 9
    assert [kv_heads_for(h, 9, 9) for h in range(9)] == list(range(9))
    with pytest.raises(ValueError, match=r"valid: \[1, 3, 9\]"):
        kv_heads_for(0, 9, 2)
    with pytest.raises(ValueError, match="query_head"):
        kv_heads_for(9, 9, 3)


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 2), n_kv=st.integers(1, 3), group=st.integers(1, 4), q_len=st.integers(1, 12),
       extra=st.integers(0, 12), d=st.sampled_from([8, 16]), causal=st.booleans())
def test_grouped_attention_matches_sdpa(b, n_kv, group, q_len, extra, d, causal):
    g = torch.Generator().manual_seed(q_len * 100 + extra)
    q = torch.randn(b, n_kv * group, q_len, d, generator=g)
    k, v = torch.randn(b, n_kv, q_len + extra, d, generator=g), torch.randn(b, n_kv, q_len + extra, d, generator=g)
    mask = None
    if causal:  # bottom-right aligned: query i is position i + extra
        mask = torch.ones(q_len, q_len + extra, dtype=torch.bool).tril(diagonal=extra)
    expected = F.scaled_dot_product_attention(q, repeat_kv(k, group), repeat_kv(v, group), attn_mask=mask)
    torch.testing.assert_close(grouped_attention(q, k, v, causal=causal), expected)


# ---------------------------------------------------------------------------------------------------- weight surgery


@given(n_kv=st.sampled_from([1, 2, 3, 4, 6, 12]), head_dim=st.sampled_from([2, 4]), dim=st.integers(1, 5))
def test_mean_pool_kv_heads_matches_loop(n_kv, head_dim, dim):
    w = torch.randn(12 * head_dim, dim)  # 12 KV heads
    pooled = mean_pool_kv_heads(w, 12, n_kv)
    group = 12 // n_kv
    for g in range(n_kv):
        heads = [w[h * head_dim:(h + 1) * head_dim] for h in range(g * group, (g + 1) * group)]
        torch.testing.assert_close(pooled[g * head_dim:(g + 1) * head_dim], torch.stack(heads).mean(0))
    torch.testing.assert_close(mean_pool_kv_heads(repeat_kv_heads(w, 12, 3), 36, 12), w)
    with pytest.raises(ValueError, match="must divide"):
        mean_pool_kv_heads(w, 12, 5)


@pytest.mark.parametrize("n_heads,n_kv", [(4, 2), (4, 1), (6, 3), (6, 2), (12, 4)])
def test_to_mha_is_exact_and_leaves_original_untouched(n_heads, n_kv):
    model = tiny_model(1, dim=16 * n_heads, n_heads=n_heads, n_kv_heads=n_kv)
    ids = torch.randint(0, model.config.vocab_size, (2, 33))
    wk_before = model.layers[0].attn.wk.weight.clone()
    mha = to_mha(model)
    assert mha.config.n_kv_heads == n_heads and model.config.n_kv_heads == n_kv
    assert mha.layers[0].attn.wk.weight.shape == (n_heads * 16, 16 * n_heads)
    torch.testing.assert_close(model.layers[0].attn.wk.weight, wk_before)
    with torch.inference_mode():
        torch.testing.assert_close(mha(ids), model(ids), atol=1e-4, rtol=1e-4)
    assert mha.lm_head.weight is mha.embed.weight  # still tied after the copy


@pytest.mark.parametrize("n_heads,n_kv,target", [(12, 2, 4), (12, 1, 4), (6, 2, 6), (6, 3, 6), (6, 1, 3)])
def test_regroup_to_a_multiple_is_exact(n_heads, n_kv, target):
    model = tiny_model(2, dim=8 * n_heads, n_heads=n_heads, n_kv_heads=n_kv)
    ids = torch.randint(0, model.config.vocab_size, (1, 20))
    with torch.inference_mode():
        torch.testing.assert_close(regroup(model, target)(ids), model(ids), atol=1e-4, rtol=1e-4)


def test_regroup_down_pools_rotated_keys():
    """Mean-pooling k-projection rows = mean-pooling the keys after RoPE (rotation is linear, same for all heads)."""
    model = tiny_model(3, n_heads=4, n_kv_heads=4)
    mqa = to_mqa(model)
    cfg = model.config
    x = torch.randn(1, 10, cfg.dim)
    cos, sin = rope_tables(cfg.head_dim, 10, cfg.rope_theta)
    cos, sin = cos[None, None], sin[None, None]  # (1, 1, seq, head_dim)
    per_head = model.layers[0].attn.wk(x).reshape(1, 10, 4, cfg.head_dim).transpose(1, 2)  # (1, 4, seq, hd)
    pooled = mqa.layers[0].attn.wk(x).reshape(1, 10, 1, cfg.head_dim).transpose(1, 2)  # (1, 1, seq, hd)
    torch.testing.assert_close(apply_rope(pooled, cos, sin),
                               apply_rope(per_head, cos, sin).mean(dim=1, keepdim=True), atol=1e-5, rtol=1e-5)


def test_regroup_rejects_non_divisors():
    model = tiny_model(4, dim=72, n_heads=9, n_kv_heads=3)
    for bad in (0, 2, 4, 10):
        with pytest.raises(ValueError, match=r"valid values are \[1, 3, 9\]"):
            regroup(model, bad)


def test_converted_models_decode_with_their_own_cache():
    model = tiny_model(5, n_heads=4, n_kv_heads=2)
    prompt, params = [5, 9, 1, 7, 3], SamplingParams(max_tokens=12, ignore_eos=True)
    original = list(generate_ids(model, prompt, params))
    for variant in (to_mha(model), regroup(model, 2)):
        assert list(generate_ids(variant, prompt, params)) == original
        assert KVCache.for_model(variant, 1, 8).k.shape[2] == variant.config.n_kv_heads
    mqa = to_mqa(model)
    assert len(list(generate_ids(mqa, prompt, params))) == 12
    assert KVCache.for_model(mqa, 1, 8).k.shape[2] == 1


# -------------------------------------------------------------------------------------------------- the real model


def test_real_model_variants(real_model):
    model, tok = real_model
    ids = torch.tensor([tok.encode("Grouped-query attention shares each key/value head among several query heads.")])
    mha, mqa = to_mha(model), to_mqa(model)
    per_token = {m.config.n_kv_heads: kv_bytes_per_token(m.config) for m in (model, mha, mqa)}
    assert per_token == {3: 23_040, 9: 3 * 23_040, 1: 23_040 // 3}  # 3 : 9 : 1
    with torch.inference_mode():
        ref, out_mha, out_mqa = model(ids), mha(ids), mqa(ids)
    diff = (out_mha - ref).abs().max().item()
    print(f"MHA conversion max |logit diff| = {diff:.2e}; MQA max |logit diff| = "
          f"{(out_mqa - ref).abs().max().item():.2f}")
    assert diff <= 1e-4
    assert (out_mqa - ref).abs().max() > 1.0  # mean-pooling without uptraining really changes the model
