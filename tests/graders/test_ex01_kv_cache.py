"""Grader for exercise 01: writing the KV cache, and one decode step's attention over it.

`check_append_kv` writes into NaN-filled buffers and checks every slot: the new keys exactly at start..end-1,
everything else untouched, CacheFullError (naming the capacity) instead of wrapping or truncating.
`check_decode_attention` compares with torch SDPA over only the filled keys, with the unwritten slots full of NaN.
Both then run inside a real KV cache driving the model class, against the model's uncached forward pass.
The `*_rejects_wrong_answers` tests run the same checks on common mistakes (skipped when grading exercises/).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.config import ModelConfig
from minillm.kv_cache import CacheFullError, KVCache
from minillm.model import Transformer
from tests.graders.conftest import TARGET, forbid_calls, load_impl

impl = load_impl("ex01_kv_cache")
grader_selftest = pytest.mark.skipif(TARGET == "exercises", reason="checks the grader itself, not your code")
NAN = float("nan")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _oracle_attention(q, k, v):
    """SDPA over exactly the keys given, K/V repeated so query head h reads KV head h // group."""
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(group, dim=1),
                                          v.float().repeat_interleave(group, dim=1)).to(q.dtype)


class LearnerCache(KVCache):
    """The course's KVCache, but writing with the learner's append_kv and decoding with their decode_attention."""

    def __init__(self, fns, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fns = fns

    def attend(self, layer, q, k, v, attn):
        append_kv, decode_attention = self.fns
        end = append_kv(self.k[layer], self.v[layer], k, v, self.start)  # start: set by begin_forward
        assert end == self.start + k.shape[2], f"append_kv returned {end}, expected {self.start + k.shape[2]}"
        if q.shape[2] == 1:
            return decode_attention(q, self.k[layer], self.v[layer], end)
        return attn(q, self.k[layer, :, :, :end], self.v[layer, :, :, :end], causal=True)  # prefill: given


def check_with_model(append_kv, decode_attention) -> None:
    """Prefill + 6 decode steps through a NaN-filled cache give the logits of the uncached forward pass."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(n_heads=4, n_kv_heads=2)).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=_gen(1))
    cache = LearnerCache((append_kv, decode_attention), model.config, 2, 24)
    cache.k.fill_(NAN)
    cache.v.fill_(NAN)
    with torch.inference_mode():
        full = model(ids)
        outs = [model(ids[:, :11], kv_cache=cache)] + [model(ids[:, t:t + 1], kv_cache=cache) for t in range(11, 17)]
    got = torch.cat(outs, dim=1)
    assert torch.isfinite(got).all(), "NaN in the logits: something read a cache slot that was never written"
    torch.testing.assert_close(got, full, atol=1e-4, rtol=1e-4)


# =========================================================================================== task 01.cache_append


def expect_cache_full(call, capacity: int) -> None:
    try:
        call()
    except CacheFullError as e:
        assert str(capacity) in str(e), f"the CacheFullError message should name the capacity ({capacity}): {e}"
    else:
        raise AssertionError("writing past the capacity must raise CacheFullError, not wrap around or truncate")


def check_append_kv(fn) -> None:
    b, h, cap, d = 2, 3, 10, 4
    k_cache, v_cache = torch.full((b, h, cap, d), NAN), torch.full((b, h, cap, d), NAN)
    k1, v1 = torch.randn(b, h, 4, d, generator=_gen(0)), torch.randn(b, h, 4, d, generator=_gen(1))
    assert fn(k_cache, v_cache, k1, v1, 0) == 4, "append_kv must return the new filled length (start + new)"
    k2, v2 = torch.randn(b, h, 1, d, generator=_gen(2)), torch.randn(b, h, 1, d, generator=_gen(3))
    assert fn(k_cache, v_cache, k2, v2, 4) == 5, "append_kv must return the new filled length (start + new)"
    torch.testing.assert_close(k_cache[:, :, :4], k1, msg="the prompt's keys must sit at positions 0..3")
    torch.testing.assert_close(v_cache[:, :, :4], v1, msg="the prompt's values must sit at positions 0..3")
    torch.testing.assert_close(k_cache[:, :, 4:5], k2, msg="a decode step's key goes at position `start`")
    torch.testing.assert_close(v_cache[:, :, 4:5], v2, msg="a decode step's value goes at position `start`")
    assert k_cache[:, :, 5:].isnan().all() and v_cache[:, :, 5:].isnan().all(), "slots past the end were written"
    # exactly full is fine...
    k3 = torch.randn(b, h, 5, d, generator=_gen(4))
    assert fn(k_cache, v_cache, k3, k3, 5) == cap
    torch.testing.assert_close(k_cache[:, :, 5:], k3)
    # ...one more token is not, and nothing may be written (no wrap-around into slot 0, no truncation)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    expect_cache_full(lambda: fn(k_cache, v_cache, k2, v2, cap), cap)
    expect_cache_full(lambda: fn(k_cache, v_cache, k1, v1, 8), cap)  # 8..11 does not fit: no partial write of 8..9
    torch.testing.assert_close(k_cache, before_k, msg="a write that does not fit must change nothing")
    torch.testing.assert_close(v_cache, before_v, msg="a write that does not fit must change nothing")


@pytest.mark.task_01_cache_append
def test_append_kv_writes_the_right_slots():
    check_append_kv(impl.append_kv)


@pytest.mark.task_01_cache_append
@settings(max_examples=20, deadline=None)
@given(start=st.integers(0, 20), new=st.integers(1, 8), spare=st.integers(0, 5), b=st.integers(1, 2),
       h=st.integers(1, 3))
def test_append_kv_any_position(start, new, spare, b, h):
    k_cache = torch.full((b, h, start + new + spare, 8), NAN)
    v_cache = k_cache.clone()
    k, v = torch.randn(b, h, new, 8), torch.randn(b, h, new, 8)
    assert impl.append_kv(k_cache, v_cache, k, v, start) == start + new
    torch.testing.assert_close(k_cache[:, :, start:start + new], k)
    torch.testing.assert_close(v_cache[:, :, start:start + new], v)
    assert k_cache[:, :, :start].isnan().all() and k_cache[:, :, start + new:].isnan().all()


def _append_off_by_one(k_cache, v_cache, k, v, start):  # writes one slot late
    end = start + k.shape[2]
    if end > k_cache.shape[2]:
        raise CacheFullError(f"capacity is {k_cache.shape[2]}")
    k_cache[:, :, start + 1:end + 1] = k
    v_cache[:, :, start + 1:end + 1] = v
    return end


def _append_wraps(k_cache, v_cache, k, v, start):  # a ring buffer: silently overwrites the oldest tokens
    cap = k_cache.shape[2]
    for i in range(k.shape[2]):
        k_cache[:, :, (start + i) % cap] = k[:, :, i]
        v_cache[:, :, (start + i) % cap] = v[:, :, i]
    return start + k.shape[2]


def _append_truncates(k_cache, v_cache, k, v, start):  # keeps what fits, drops the rest without a word
    end = min(start + k.shape[2], k_cache.shape[2])
    k_cache[:, :, start:end] = k[:, :, :end - start]
    v_cache[:, :, start:end] = v[:, :, :end - start]
    return end


def _append_writes_then_checks(k_cache, v_cache, k, v, start):  # raises, but after a partial write
    end = start + k.shape[2]
    k_cache[:, :, start:end] = k[:, :, :k_cache.shape[2] - start]
    v_cache[:, :, start:end] = v[:, :, :k_cache.shape[2] - start]
    if end > k_cache.shape[2]:
        raise CacheFullError(f"capacity is {k_cache.shape[2]}")
    return end


def _append_returns_start(k_cache, v_cache, k, v, start):  # forgets to report the new length
    end = start + k.shape[2]
    if end > k_cache.shape[2]:
        raise CacheFullError(f"capacity is {k_cache.shape[2]}")
    k_cache[:, :, start:end] = k
    v_cache[:, :, start:end] = v
    return start


@grader_selftest
@pytest.mark.parametrize("wrong", [_append_off_by_one, _append_wraps, _append_truncates, _append_writes_then_checks,
                                   _append_returns_start])
def test_append_kv_grader_rejects_wrong_answers(wrong):
    with pytest.raises(AssertionError):
        check_append_kv(wrong)


# ======================================================================================= task 01.cached_attention


def check_decode_attention(fn) -> None:
    for (b, n_kv, group, n_filled, spare, d), dtype in [((1, 1, 1, 1, 3, 8), torch.float32),
                                                       ((2, 3, 3, 17, 5, 16), torch.float32),
                                                       ((3, 2, 4, 9, 0, 8), torch.float32),
                                                       ((2, 3, 3, 12, 4, 16), torch.bfloat16)]:
        g = _gen(n_filled)
        q = torch.randn(b, n_kv * group, 1, d, generator=g).to(dtype)
        k = torch.randn(b, n_kv, n_filled, d, generator=g).to(dtype)
        v = torch.randn(b, n_kv, n_filled, d, generator=g).to(dtype)
        k_cache = torch.cat([k, torch.full((b, n_kv, spare, d), NAN, dtype=dtype)], dim=2)  # unwritten tail: NaN
        v_cache = torch.cat([v, torch.full((b, n_kv, spare, d), NAN, dtype=dtype)], dim=2)
        out = fn(q, k_cache, v_cache, n_filled)
        assert out.shape == q.shape, f"output shape {tuple(out.shape)}, expected {tuple(q.shape)}"
        assert out.dtype == dtype, f"output dtype must be q's ({dtype}), got {out.dtype}"
        assert torch.isfinite(out).all(), "NaN in the output: the attention read slots past n_filled"
        tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}
        torch.testing.assert_close(out, _oracle_attention(q, k, v), **tol)
    # large logits (scores of several hundred): exp overflows float32 past 88 unless the max is subtracted first
    g = _gen(5)
    q, k, v = torch.randn(2, 6, 1, 16, generator=g) * 12, torch.randn(2, 2, 9, 16, generator=g) * 12, \
        torch.randn(2, 2, 9, 16, generator=g)
    out = fn(q, k, v, 9)
    assert torch.isfinite(out).all(), "scores of a few hundred gave inf/nan: subtract the row max before exp"
    torch.testing.assert_close(out, _oracle_attention(q, k, v), atol=1e-4, rtol=1e-4)


@pytest.mark.task_01_cached_attention
def test_decode_attention_matches_sdpa_over_filled_cache():
    check_decode_attention(impl.decode_attention)


@pytest.mark.task_01_cached_attention
def test_decode_attention_no_library_call():
    check_decode_attention(impl.decode_attention)  # a stub must not pass by calling nothing at all
    forbid_calls(impl.decode_attention, ["scaled_dot_product_attention", "sdpa_attention", "naive_attention",
                                         "grouped_attention", "minillm"])


@pytest.mark.task_01_cache_append
def test_your_append_drives_the_model_like_no_cache():
    from minillm.kv_cache import decode_attention as reference_decode  # the other task's part: the reference
    check_with_model(impl.append_kv, reference_decode)


@pytest.mark.task_01_cached_attention
def test_your_decode_drives_the_model_like_no_cache():
    from minillm.kv_cache import append_kv as reference_append  # the other task's part: the reference
    check_with_model(reference_append, impl.decode_attention)


def _decode_whole_buffer(q, k_cache, v_cache, n_filled):  # ignores n_filled: reads garbage slots
    return _oracle_attention(q, k_cache, v_cache)


def _decode_misses_newest(q, k_cache, v_cache, n_filled):  # off by one: the token does not see itself
    return _oracle_attention(q, k_cache[:, :, :max(n_filled - 1, 1)], v_cache[:, :, :max(n_filled - 1, 1)])


def _decode_modulo_heads(q, k_cache, v_cache, n_filled):  # query head h reads KV head h % n_kv_heads
    group = q.shape[1] // k_cache.shape[1]
    k, v = k_cache[:, :, :n_filled].repeat(1, group, 1, 1), v_cache[:, :, :n_filled].repeat(1, group, 1, 1)
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float()).to(q.dtype)


def _decode_no_scale(q, k_cache, v_cache, n_filled):  # forgets 1/sqrt(head_dim)
    group = q.shape[1] // k_cache.shape[1]
    k = k_cache[:, :, :n_filled].float().repeat_interleave(group, dim=1)
    v = v_cache[:, :, :n_filled].float().repeat_interleave(group, dim=1)
    return ((q.float() @ k.transpose(-1, -2)).softmax(-1) @ v).to(q.dtype)


@grader_selftest
@pytest.mark.parametrize("wrong", [_decode_whole_buffer, _decode_misses_newest, _decode_modulo_heads,
                                   _decode_no_scale])
def test_decode_attention_grader_rejects_wrong_answers(wrong):
    with pytest.raises(AssertionError):
        check_decode_attention(wrong)


@grader_selftest
def test_model_check_rejects_wrong_answers():
    from minillm.kv_cache import append_kv, decode_attention

    check_with_model(append_kv, decode_attention)  # the reference passes...
    for wrong_append in (_append_off_by_one, _append_returns_start):
        with pytest.raises(AssertionError):  # ...and each mistake is caught end to end
            check_with_model(wrong_append, decode_attention)
    for wrong_decode in (_decode_whole_buffer, _decode_misses_newest, _decode_modulo_heads):
        with pytest.raises(AssertionError):
            check_with_model(append_kv, wrong_decode)


# ======================================================================================== the real model, your cache


@pytest.mark.task_01_real_model
def test_your_cache_decodes_smollm2(real_model):
    """minillm.generate on SmolLM2-135M (float32) with a KVCache that writes with your append_kv and decodes with your
    decode_attention, its unwritten slots full of NaN: the same greedy tokens as the reference. Stands on exercise
    00: your rms_norm / apply_rope / naive_attention / sampler run underneath where you wrote them (else minillm's)."""
    import minillm.kv_cache
    from minillm.course.seams import check_on_ladder
    from tests.graders.real_model import greedy_ids, reference_greedy, same_tokens

    model, tok = real_model
    want = reference_greedy(model, tok)

    def check():
        cache_cls = minillm.kv_cache.KVCache  # yours, swapped in by the ladder

        class NaNFilled(cache_cls):  # a slot read before it is written poisons the output
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.k.fill_(NAN)
                self.v.fill_(NAN)

        minillm.kv_cache.KVCache = NaNFilled
        try:
            same_tokens(greedy_ids(model, tok), want, tok, "SmolLM2 with your KV cache")
        finally:
            minillm.kv_cache.KVCache = cache_cls

    check_on_ladder(model, impl, check)
