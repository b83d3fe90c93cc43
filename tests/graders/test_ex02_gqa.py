"""Grader for exercise 02: grouped-query attention, and mean-pooling KV heads.

`check_grouped_attention` compares with torch SDPA on K/V repeated so that query head h reads KV head
h // (n_heads // n_kv_heads), causal masks aligned bottom-right. `check_mean_pool` compares with a loop over heads.
The `*_rejects_wrong_answers` tests run the same checks on common mistakes (skipped when grading exercises/).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.graders.conftest import TARGET, forbid_calls, load_impl

impl = load_impl("ex02_gqa")
grader_selftest = pytest.mark.skipif(TARGET == "exercises", reason="checks the grader itself, not your code")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _oracle(q, k, v, causal):
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)  # h -> h // group
    mask = None
    if causal:  # the q_len queries are the last q_len of the kv_len positions
        q_len, kv_len = q.shape[2], k.shape[2]
        mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=kv_len - q_len)
    return F.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask).to(q.dtype)


# ====================================================================================== task 02.grouped_attention

CASES = [  # (batch, n_kv_heads, group, q_len, kv_len)
    (1, 3, 3, 7, 7),  # SmolLM2's 9 query heads over 3 KV heads, prefill
    (2, 2, 4, 1, 13),  # decode: one query over a longer cache
    (1, 3, 3, 5, 11),  # a chunk over a cache: bottom-right causal
    (2, 1, 6, 6, 6),  # MQA
    (1, 4, 1, 5, 5),  # MHA
]


def check_grouped_attention(fn) -> None:
    for i, (b, n_kv, group, q_len, kv_len) in enumerate(CASES):
        g = _gen(i)
        q = torch.randn(b, n_kv * group, q_len, 16, generator=g)
        k, v = torch.randn(b, n_kv, kv_len, 16, generator=g), torch.randn(b, n_kv, kv_len, 16, generator=g)
        for causal in (True, False):
            out = fn(q, k, v, causal=causal)
            assert out.shape == q.shape, f"output shape {tuple(out.shape)}, expected {tuple(q.shape)}"
            torch.testing.assert_close(out, _oracle(q, k, v, causal),
                                       msg=f"n_kv_heads={n_kv} group={group} q_len={q_len} kv_len={kv_len} "
                                           f"causal={causal}: output differs from SDPA with h -> h // group")
    g = _gen(11)  # large logits: scores of several hundred overflow exp in float32 unless the row max is subtracted
    q, k, v = torch.randn(1, 6, 5, 16, generator=g) * 12, torch.randn(1, 2, 5, 16, generator=g) * 12, \
        torch.randn(1, 2, 5, 16, generator=g)
    out = fn(q, k, v, causal=True)
    assert torch.isfinite(out).all(), "scores of a few hundred gave inf/nan: subtract the row max before exp"
    torch.testing.assert_close(out, _oracle(q, k, v, True), atol=1e-4, rtol=1e-4)
    qb = torch.randn(1, 6, 4, 16, generator=_gen(9)).bfloat16()
    kb, vb = torch.randn(1, 2, 4, 16, generator=_gen(10)).bfloat16(), torch.randn(1, 2, 4, 16).bfloat16()
    out = fn(qb, kb, vb, causal=True)
    assert out.dtype == torch.bfloat16, f"output dtype must be q's (bfloat16), got {out.dtype}"
    torch.testing.assert_close(out, _oracle(qb, kb, vb, True), atol=2e-2, rtol=2e-2)


@pytest.mark.task_02_grouped_attention
def test_grouped_attention_matches_sdpa():
    check_grouped_attention(impl.grouped_attention)


@pytest.mark.task_02_grouped_attention
@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 2), n_kv=st.integers(1, 4), group=st.integers(1, 4), q_len=st.integers(1, 9),
       extra=st.integers(0, 9), causal=st.booleans())
def test_grouped_attention_any_shape(b, n_kv, group, q_len, extra, causal):
    g = _gen(q_len * 10 + extra)
    q = torch.randn(b, n_kv * group, q_len, 8, generator=g)
    k, v = torch.randn(b, n_kv, q_len + extra, 8, generator=g), torch.randn(b, n_kv, q_len + extra, 8, generator=g)
    torch.testing.assert_close(impl.grouped_attention(q, k, v, causal=causal), _oracle(q, k, v, causal))


@pytest.mark.task_02_grouped_attention
def test_grouped_attention_no_library_call():
    check_grouped_attention(impl.grouped_attention)  # a stub must not pass by calling nothing at all
    forbid_calls(impl.grouped_attention, ["scaled_dot_product_attention", "sdpa_attention", "naive_attention",
                                          "repeat_kv", "minillm"])


def _gqa_modulo(q, k, v, causal=True):  # query head h reads KV head h % n_kv_heads (tiling, not grouping)
    group = q.shape[1] // k.shape[1]
    return _plain(q, k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1), causal)


def _gqa_top_left_mask(q, k, v, causal=True):  # torch's is_causal convention: wrong when q_len < kv_len
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _gqa_only_first_kv_head(q, k, v, causal=True):  # everyone reads KV head 0 (as if MQA)
    return _plain(q, k[:, :1].expand(-1, q.shape[1], -1, -1), v[:, :1].expand(-1, q.shape[1], -1, -1), causal)


def _plain(q, k, v, causal):
    return _oracle(q, k, v, causal)  # with n_heads K/V heads the oracle's grouping is the identity


@grader_selftest
@pytest.mark.parametrize("wrong", [_gqa_modulo, _gqa_top_left_mask, _gqa_only_first_kv_head])
def test_grouped_attention_grader_rejects_wrong_answers(wrong):
    with pytest.raises(AssertionError):
        check_grouped_attention(wrong)


# ============================================================================================= task 02.mean_pool


def check_mean_pool(fn) -> None:
    for n_kv, new, head_dim, dim in [(3, 1, 4, 5), (6, 2, 2, 3), (6, 3, 2, 3), (4, 4, 3, 2), (9, 3, 64, 8)]:
        w = torch.randn(n_kv * head_dim, dim, generator=_gen(n_kv * 10 + new))
        out = fn(w, n_kv, new)
        assert out.shape == (new * head_dim, dim), f"shape {tuple(out.shape)}, expected {(new * head_dim, dim)}"
        group = n_kv // new
        for gi in range(new):  # new head gi = mean of old heads gi*group .. gi*group + group - 1 (adjacent heads)
            heads = torch.stack([w[h * head_dim:(h + 1) * head_dim] for h in range(gi * group, (gi + 1) * group)])
            torch.testing.assert_close(out[gi * head_dim:(gi + 1) * head_dim], heads.mean(0),
                                       msg=f"{n_kv} -> {new} KV heads: new head {gi} is not the mean of old "
                                           f"heads {gi * group}..{(gi + 1) * group - 1}")
    wb = torch.randn(6 * 4, 8, generator=_gen(7)).bfloat16()
    outb = fn(wb, 6, 2)
    assert outb.dtype == torch.bfloat16, f"output dtype must be w's (bfloat16), got {outb.dtype}"
    exact = wb.float().reshape(2, 3, 4, 8).mean(1).reshape(8, 8)
    torch.testing.assert_close(outb.float(), exact.bfloat16().float())  # averaged in float32, rounded once
    try:
        fn(torch.randn(6 * 4, 8), 6, 4)
    except ValueError:
        pass
    else:
        raise AssertionError("pooling 6 KV heads into 4 must raise ValueError: 4 does not divide 6")


@pytest.mark.task_02_mean_pool
def test_mean_pool_matches_per_head_loop():
    check_mean_pool(impl.mean_pool_kv_heads)


@pytest.mark.task_02_mean_pool
def test_mean_pool_on_a_model_keeps_grouped_attention_consistent():
    """Pooling K/V projections = pooling the keys/values each group of query heads reads (projections are linear)."""
    g = _gen(3)
    x, wk = torch.randn(5, 32, generator=g), torch.randn(6 * 8, 32, generator=g)  # 6 KV heads of 8 dims
    pooled_keys = (x @ impl.mean_pool_kv_heads(wk, 6, 2).T).reshape(5, 2, 8)
    keys = (x @ wk.T).reshape(5, 2, 3, 8).mean(2)  # (tokens, new heads, group, head_dim) -> group mean
    torch.testing.assert_close(pooled_keys, keys, atol=1e-4, rtol=1e-4)


def _pool_strided(w, n_kv_heads, new_n_kv_heads):  # groups heads g, g + new, g + 2 new... (h % new)
    if n_kv_heads % new_n_kv_heads:
        raise ValueError("must divide")
    hd = w.shape[0] // n_kv_heads
    return w.reshape(n_kv_heads // new_n_kv_heads, new_n_kv_heads, hd, -1).mean(0).reshape(new_n_kv_heads * hd, -1)


def _pool_sum(w, n_kv_heads, new_n_kv_heads):  # sums instead of averaging: keys grow by the group size
    if n_kv_heads % new_n_kv_heads:
        raise ValueError("must divide")
    hd = w.shape[0] // n_kv_heads
    return w.reshape(new_n_kv_heads, n_kv_heads // new_n_kv_heads, hd, -1).sum(1).reshape(new_n_kv_heads * hd, -1)


def _pool_rows(w, n_kv_heads, new_n_kv_heads):  # averages neighbouring rows instead of heads
    if n_kv_heads % new_n_kv_heads:
        raise ValueError("must divide")
    group = n_kv_heads // new_n_kv_heads
    return w.reshape(-1, group, w.shape[1]).mean(1)


def _pool_bf16_arithmetic(w, n_kv_heads, new_n_kv_heads):  # correct, but averages in bf16 (rounds at every add)
    if n_kv_heads % new_n_kv_heads:
        raise ValueError("must divide")
    hd = w.shape[0] // n_kv_heads
    heads = w.reshape(new_n_kv_heads, n_kv_heads // new_n_kv_heads, hd, -1)
    acc = heads[:, 0]
    for i in range(1, heads.shape[1]):
        acc = acc + heads[:, i]
    return (acc / heads.shape[1]).reshape(new_n_kv_heads * hd, -1)


@grader_selftest
@pytest.mark.parametrize("wrong", [_pool_strided, _pool_sum, _pool_rows, _pool_bf16_arithmetic])
def test_mean_pool_grader_rejects_wrong_answers(wrong):
    with pytest.raises(AssertionError):
        check_mean_pool(wrong)


# ============================================================================= the real model, your grouped attention


@pytest.mark.task_02_real_model
def test_your_grouped_attention_runs_smollm2(real_model):
    """Your grouped_attention as SmolLM2-135M's attention backend (9 query heads on 3 KV heads, float32): the chat
    prompt's logits within 1e-3 of the reference's, and generate()'s greedy tokens (your attention runs the prefill
    and every decode step over minillm's contiguous cache) identical. Stands on exercise 00 (your norm, RoPE and
    sampler underneath where you wrote them, else minillm's)."""
    from tests.graders.real_model import check_attention_backend

    model, tok = real_model
    check_attention_backend(model, tok, impl, "SmolLM2 with your grouped attention")
