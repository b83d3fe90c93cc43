"""The contiguous KV cache: cached decoding must give exactly what recomputing the whole sequence gives.

Oracles: the uncached forward pass over the full sequence (the baseline the cache replaces), torch SDPA for the
decode attention, and the KV-size formula worked by hand for published model shapes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm.attention import sdpa_attention
from minillm.config import LLAMA2_7B, LLAMA2_70B, SMOLLM2_135M
from minillm.api import generate
from minillm.kv_cache import (
    CacheFullError,
    KVCache,
    append_kv,
    decode_attention,
    kv_bytes,
    kv_bytes_per_token,
    max_tokens_in_budget,
)
from minillm.model import Transformer
from tests.conftest import tiny_model


@torch.inference_mode()
def prefill_then_decode(model: Transformer, ids: torch.Tensor, prompt_len: int, cache: KVCache) -> torch.Tensor:
    """Logits for every position of ids (batch, seq): the prompt in one forward, then one token per step."""
    outs = [model(ids[:, :prompt_len], kv_cache=cache)]
    for t in range(prompt_len, ids.shape[1]):
        outs.append(model(ids[:, t:t + 1], kv_cache=cache))
    return torch.cat(outs, dim=1)


# ------------------------------------------------------------------------------------------ same output as no cache


def test_real_model_cached_greedy_equals_uncached(real_model):
    model, tok = real_model
    prompt = "Write one sentence about why the sky is blue."
    cached = generate(model, tok, prompt, max_new_tokens=24, cache="contiguous", ignore_eos=True)
    uncached = generate(model, tok, prompt, max_new_tokens=24, cache="none", ignore_eos=True)
    print(f"cached greedy text: {cached.text!r}")
    assert len(cached.token_ids) == 24
    assert cached.token_ids == uncached.token_ids


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt_len=st.integers(1, 200), n_decode=st.integers(1, 6), batch=st.integers(1, 3),
       n_kv_heads=st.sampled_from([1, 2, 4]), backend=st.sampled_from(["sdpa", "naive"]), seed=st.integers(0, 2**16))
def test_prefill_plus_decode_matches_full_forward(prompt_len, n_decode, batch, n_kv_heads, backend, seed):
    model = tiny_model(seed % 4, n_kv_heads=n_kv_heads)
    model.attn_backend = backend
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len + n_decode), generator=g)
    with torch.inference_mode():
        full = model(ids)  # (batch, seq, vocab): the uncached oracle
    cache = KVCache.for_model(model, batch, prompt_len + n_decode)
    stepwise = prefill_then_decode(model, ids, prompt_len, cache)
    assert cache.seq_len == prompt_len + n_decode
    torch.testing.assert_close(stepwise, full, atol=1e-4, rtol=1e-4)


def test_cache_works_chunk_by_chunk():
    """Chunked prefill (several tokens over a non-empty cache) uses the bottom-right causal mask."""
    model = tiny_model(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 37))
    cache = KVCache.for_model(model, 2, 40)
    with torch.inference_mode():
        full = model(ids)
        chunks = [model(ids[:, a:b], kv_cache=cache) for a, b in [(0, 10), (10, 11), (11, 30), (30, 37)]]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------ capacity and NaN


def test_writing_past_capacity_raises_and_writes_nothing():
    model = tiny_model(2)
    cache = KVCache.for_model(model, 1, 8)
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    with torch.inference_mode():
        model(ids[:, :8], kv_cache=cache)  # exactly full: allowed
        before = cache.k.clone()
        with pytest.raises(CacheFullError, match=r"capacity is 8 tokens"):
            model(ids[:, 8:9], kv_cache=cache)
    assert cache.seq_len == 8
    torch.testing.assert_close(cache.k, before)  # nothing wrapped around to slot 0
    fresh = KVCache.for_model(model, 1, 8)
    with pytest.raises(CacheFullError, match=r"positions 0\.\.8"), torch.inference_mode():
        model(ids, kv_cache=fresh)  # a 9-token prompt does not fit either: no silent truncation


def test_append_kv_raises_before_writing():
    model = tiny_model(3)
    k = torch.zeros(1, 2, 5, 16)
    with pytest.raises(CacheFullError, match="capacity is 5"):
        append_kv(k, k.clone(), torch.ones(1, 2, 3, 16), torch.ones(1, 2, 3, 16), start=3)
    assert (k == 0).all()
    cache = KVCache.for_model(model, 1, 4)
    cache.seq_len = 4  # as if 4 tokens were cached
    with pytest.raises(CacheFullError), torch.inference_mode():
        model(torch.tensor([[1]]), kv_cache=cache)


@settings(max_examples=15, deadline=None)
@given(prompt_len=st.integers(1, 60), n_decode=st.integers(1, 4), batch=st.integers(1, 3),
       spare=st.integers(1, 50))
def test_reads_never_touch_unwritten_slots(prompt_len, n_decode, batch, spare):
    model = tiny_model(4)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len + n_decode))
    cache = KVCache.for_model(model, batch, prompt_len + n_decode + spare)
    cache.k.fill_(float("nan"))  # any read of an unwritten slot poisons the softmax and shows up as NaN
    cache.v.fill_(float("nan"))
    out = prefill_then_decode(model, ids, prompt_len, cache)
    assert torch.isfinite(out).all()
    with torch.inference_mode():
        torch.testing.assert_close(out, model(ids), atol=1e-4, rtol=1e-4)


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 3), n_kv=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 3]),
       n_filled=st.integers(1, 40), spare=st.integers(0, 10), d=st.sampled_from([8, 16]))
def test_decode_attention_matches_sdpa_over_filled_prefix(batch, n_kv, group, n_filled, spare, d):
    g = torch.Generator().manual_seed(n_filled * 31 + spare)
    q = torch.randn(batch, n_kv * group, 1, d, generator=g)
    k_cache = torch.full((batch, n_kv, n_filled + spare, d), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    k, v = torch.randn(batch, n_kv, n_filled, d, generator=g), torch.randn(batch, n_kv, n_filled, d, generator=g)
    assert append_kv(k_cache, v_cache, k[:, :, :-1], v[:, :, :-1], 0) == n_filled - 1
    assert append_kv(k_cache, v_cache, k[:, :, -1:], v[:, :, -1:], n_filled - 1) == n_filled
    out = decode_attention(q, k_cache, v_cache, n_filled)
    torch.testing.assert_close(out, sdpa_attention(q, k, v, causal=True))
    with pytest.raises(ValueError, match="q_len"):
        decode_attention(torch.randn(batch, n_kv * group, 2, d), k_cache, v_cache, n_filled)


# ------------------------------------------------------------------------------------------------- KV-size formula


def test_kv_bytes_per_token_worked_examples():
    assert kv_bytes_per_token(SMOLLM2_135M, torch.float16) == 2 * 30 * 3 * 64 * 2 == 23_040
    assert kv_bytes_per_token(SMOLLM2_135M, torch.float32) == 46_080
    assert kv_bytes_per_token(SMOLLM2_135M, 1) == 11_520  # an int is bytes per value (int8 cache)
    assert kv_bytes(LLAMA2_7B, 4096, dtype=torch.float16) == 2 * 32 * 32 * 128 * 2 * 4096 == 2 * 2**30
    assert kv_bytes_per_token(LLAMA2_70B, torch.float16) == 2 * 80 * 8 * 128 * 2  # GQA: 8 KV heads of 64
    assert kv_bytes(SMOLLM2_135M, 100, batch=3) == 3 * 100 * 23_040


def test_kv_bytes_matches_allocated_cache():
    model = tiny_model(5)
    cache = KVCache.for_model(model, 3, 50)
    assert cache.nbytes() == kv_bytes(model.config, 50, batch=3, dtype=torch.float32)


def test_max_tokens_in_budget():
    gib = 2**30
    assert max_tokens_in_budget(LLAMA2_7B, 2 * gib, torch.float16) == 4096
    assert max_tokens_in_budget(SMOLLM2_135M, 2 * gib, torch.float16) == 2 * gib // 23_040 == 93_206
    # GQA is why a 70B model fits more context per byte than a 7B one: 8 KV heads instead of 32 (x 80/32 layers)
    assert max_tokens_in_budget(LLAMA2_70B, 2 * gib) == 6553
    assert max_tokens_in_budget(SMOLLM2_135M, 23_039) == 0
    with pytest.raises(ValueError, match="budget_bytes"):
        max_tokens_in_budget(SMOLLM2_135M, -1)
