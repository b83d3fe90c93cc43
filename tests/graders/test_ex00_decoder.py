"""Grader for exercise 00: RMSNorm, RoPE, causal GQA attention, sampling.

Each `check_*` compares an implementation with an independent oracle: torch's F.rms_norm, a loop over complex
numbers for RoPE, torch SDPA for attention, a plain-Python nucleus computation plus sampled frequencies for the
sampler. The `test_*_rejects_wrong_answers` tests run the same checks on common mistakes, so the grader provably
fails them (they test the grader, not your code, and are skipped when grading exercises/).
"""

from __future__ import annotations

import cmath
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.graders.conftest import TARGET, forbid_calls, load_impl

impl = load_impl("ex00_decoder")
grader_selftest = pytest.mark.skipif(TARGET == "exercises", reason="checks the grader itself, not your code")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ================================================================================================= task 00.rmsnorm


def check_rms_norm(fn) -> None:
    g = _gen(0)
    # float32 against torch's own RMSNorm
    x, w = torch.randn(3, 5, 64, generator=g), torch.randn(64, generator=g)
    torch.testing.assert_close(fn(x, w, 1e-5), F.rms_norm(x, (64,), w, 1e-5))
    # eps goes inside the square root: visible when activations are as small as eps
    x_small = torch.randn(4, 32, generator=g) * 1e-3
    torch.testing.assert_close(fn(x_small, torch.ones(32), 1e-2), F.rms_norm(x_small, (32,), eps=1e-2))
    # float16 activations of a few hundred: x^2 overflows float16 (max 65504), so the statistics need float32
    x16, w16 = (torch.randn(8, 576, generator=g) * 300).half(), (1 + 0.1 * torch.randn(576, generator=g)).half()
    out16 = fn(x16, w16, 1e-5)
    assert out16.dtype == torch.float16, f"output dtype must be the input's (float16), got {out16.dtype}"
    assert torch.isfinite(out16).all(), ("float16 input of magnitude ~300 gave inf/nan: compute the mean of squares "
                                         "in float32")
    torch.testing.assert_close(out16.float(), F.rms_norm(x16.float(), (576,), w16.float(), 1e-5), atol=2e-2, rtol=1e-2)
    # bfloat16: normalising in float32 rounds once; normalising in bf16 rounds at every step and is measurably worse
    xb, wb = (torch.randn(256, 576, generator=g) * 30).bfloat16(), (1 + 0.1 * torch.randn(576, generator=g)).bfloat16()
    outb = fn(xb, wb, 1e-5)
    assert outb.dtype == torch.bfloat16, f"output dtype must be the input's (bfloat16), got {outb.dtype}"
    exact = F.rms_norm(xb.float(), (576,), wb.float(), 1e-5)
    reference = F.rms_norm(xb.float(), (576,), eps=1e-5).bfloat16() * wb  # float32 statistics, one rounding
    err, ref_err = (outb.float() - exact).abs().mean(), (reference.float() - exact).abs().mean()
    assert err <= 1.1 * ref_err, (
        f"bfloat16 output is {err / ref_err:.2f}x less accurate than normalising in float32: upcast x first")


@pytest.mark.task_00_rmsnorm
def test_rms_norm_matches_torch():
    check_rms_norm(impl.rms_norm)
    forbid_calls(impl.rms_norm, ["rms_norm", "layer_norm", "RMSNorm", "minillm"])


@pytest.mark.task_00_rmsnorm
def test_rms_norm_any_leading_shape():
    x, w = torch.randn(2, 1, 7, 16), torch.randn(16)
    torch.testing.assert_close(impl.rms_norm(x, w, 1e-6), F.rms_norm(x, (16,), w, 1e-6))


def _rms_eps_outside(x, weight, eps):
    xf = x.float()
    return (xf / (xf.pow(2).mean(-1, keepdim=True).sqrt() + eps)).to(x.dtype) * weight


def _rms_in_input_dtype(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rms_no_weight(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@grader_selftest
@pytest.mark.parametrize("wrong", [_rms_eps_outside, _rms_in_input_dtype, _rms_no_weight])
def test_rms_norm_grader_rejects_wrong_answers(wrong):
    with pytest.raises(AssertionError):
        check_rms_norm(wrong)


# ==================================================================================================== task 00.rope


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (batch, 1, seq, head_dim) for positions (batch, seq): dims i and i + head_dim/2 share a
    frequency theta^(-2i/head_dim)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions.double()[..., None] * inv_freq  # (batch, seq, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos().float(), angles.sin().float()


def rope_oracle(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Loop over (batch, position, pair): the pair (x[i], x[i + d/2]) is the complex number x[i] + j x[i + d/2],
    rotated by the angle position * theta^(-2i/d)."""
    b, h, s, d = x.shape
    out = torch.empty(b, h, s, d, dtype=torch.float64)
    xd = x.double()
    for bi in range(b):
        for si in range(s):
            pos = int(positions[bi, si])
            for i in range(d // 2):
                rot = cmath.exp(1j * pos * theta ** (-2 * i / d))
                for hi in range(h):
                    z = complex(xd[bi, hi, si, i], xd[bi, hi, si, i + d // 2]) * rot
                    out[bi, hi, si, i], out[bi, hi, si, i + d // 2] = z.real, z.imag
    return out


def check_apply_rope(fn) -> None:
    g = _gen(1)
    cases = [  # (batch, heads, seq, head_dim, positions, theta)
        (1, 2, 5, 8, torch.arange(5)[None], 10_000.0),
        (2, 3, 4, 16, torch.tensor([[0, 1, 2, 3], [100, 101, 102, 103]]), 100_000.0),  # a cache offset per row
        (1, 1, 3, 64, torch.tensor([[7, 500, 8191]]), 100_000.0),  # the real model's head_dim, far positions
    ]
    for b, h, s, d, positions, theta in cases:
        x = torch.randn(b, h, s, d, generator=g)
        cos, sin = rope_cos_sin(positions, d, theta)
        out = fn(x, cos, sin)
        assert out.shape == x.shape, f"shape {tuple(out.shape)}, expected {tuple(x.shape)}"
        torch.testing.assert_close(out.double(), rope_oracle(x, positions, theta), atol=1e-4, rtol=1e-4,
                                   msg=lambda m, ctx=f"batch={b}, head_dim={d}":
                                       f"RoPE vs rotate-half oracle ({ctx}): {m}")
    # position 0 is the identity; rotations preserve each pair's length
    x = torch.randn(1, 2, 1, 8, generator=g)
    cos, sin = rope_cos_sin(torch.zeros(1, 1), 8, 10_000.0)
    torch.testing.assert_close(fn(x, cos, sin), x)
    xb = torch.randn(1, 2, 3, 16, generator=g).bfloat16()
    cos, sin = rope_cos_sin(torch.arange(3)[None], 16, 10_000.0)
    outb = fn(xb, cos, sin)
    assert outb.dtype == torch.bfloat16, f"output dtype must be the input's (bfloat16), got {outb.dtype}"
    torch.testing.assert_close(outb.double(), rope_oracle(xb.float(), torch.arange(3)[None], 10_000.0),
                               atol=2e-2, rtol=2e-2)
    # bfloat16 at the real model's shape and far positions: rotate in float32 and round once. Rotating in bf16 rounds
    # cos, sin and every product (measured on this case: 1.66x the mean error of one rounding; the bound is 1.2x)
    positions = torch.arange(0, 8192, 97)[None]
    xb = (torch.randn(1, 3, positions.shape[1], 64, generator=g) * 4).bfloat16()
    cos, sin = rope_cos_sin(positions, 64, 100_000.0)
    exact = fn(xb.float(), cos, sin).double()  # the float32 path of the same function (checked above)
    err = (fn(xb, cos, sin).double() - exact).abs().mean()
    one_rounding = (exact.bfloat16().double() - exact).abs().mean()
    assert err <= 1.2 * one_rounding, (
        f"bfloat16 RoPE error {err:.2e} is {err / one_rounding:.2f}x that of rounding the float32 result once "
        f"({one_rounding:.2e}): upcast x, cos and sin to float32, rotate, then cast back")


@pytest.mark.task_00_rope
def test_apply_rope_matches_complex_rotation():
    check_apply_rope(impl.apply_rope)
    forbid_calls(impl.apply_rope, ["apply_rotary_pos_emb", "minillm"])


def _rope_interleaved(x, cos, sin):  # GPT-J / llama.cpp pairing (2i, 2i+1): right idea, wrong layout for our weights
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[..., : x.shape[-1] // 2], sin[..., : x.shape[-1] // 2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2).to(x.dtype)


def _rope_wrong_direction(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([x2, -x1], dim=-1).float() * sin).to(x.dtype)


def _rope_no_rotation_of_second_half(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-x2, torch.zeros_like(x1)], dim=-1).float() * sin).to(x.dtype)


@grader_selftest
@pytest.mark.parametrize("wrong", [_rope_interleaved, _rope_wrong_direction, _rope_no_rotation_of_second_half])
def test_apply_rope_grader_rejects_wrong_answers(wrong):
    with pytest.raises(AssertionError):
        check_apply_rope(wrong)


# =============================================================================================== task 00.attention


def attention_oracle(q, k, v, causal: bool):
    """torch SDPA with GQA and a bottom-right causal mask built from tril."""
    q_len, kv_len = q.shape[2], k.shape[2]
    mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=kv_len - q_len) if causal else None
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                          enable_gqa=q.shape[1] != k.shape[1])


ATTN_CASES = [  # (batch, n_heads, n_kv_heads, q_len, kv_len, head_dim)
    (2, 4, 4, 8, 8, 16),  # MHA prefill
    (1, 9, 3, 7, 7, 64),  # the real model's GQA: 9 query heads share 3 KV heads
    (2, 6, 2, 1, 13, 8),  # decode: one query sees every key
    (1, 4, 1, 5, 12, 16),  # MQA, a chunk of queries over a longer cache (bottom-right alignment)
]


def check_attention(fn) -> None:
    g = _gen(2)
    for b, h, hkv, q_len, kv_len, d in ATTN_CASES:
        q = torch.randn(b, h, q_len, d, generator=g)
        k, v = torch.randn(b, hkv, kv_len, d, generator=g), torch.randn(b, hkv, kv_len, d, generator=g)
        for causal in (True, False):
            out = fn(q, k, v, causal=causal)
            assert out.shape == q.shape, f"output shape {tuple(out.shape)}, expected {tuple(q.shape)}"
            torch.testing.assert_close(out, attention_oracle(q, k, v, causal), atol=1e-5, rtol=1e-4,
                                       msg=lambda m, ctx=f"{h=} {hkv=} {q_len=} {kv_len=} {causal=}":
                                           f"vs SDPA ({ctx}): {m}")
    # large logits (scores of several hundred): exp overflows float32 past 88, so the softmax must subtract the max
    q, k, v = torch.randn(1, 4, 6, 16, generator=g) * 12, torch.randn(1, 2, 6, 16, generator=g) * 12, \
        torch.randn(1, 2, 6, 16, generator=g)
    out = fn(q, k, v, causal=True)
    assert torch.isfinite(out).all(), ("scores of a few hundred gave inf/nan: exp(s) overflows float32 past s = 88; "
                                       "subtract each row's max before exp (softmax is unchanged by a shift)")
    torch.testing.assert_close(out, attention_oracle(q, k, v, True), atol=1e-4, rtol=1e-4)
    q, k, v = (torch.randn(1, 4, 6, 16, generator=g).bfloat16() for _ in range(3))
    out = fn(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16, f"output dtype must be q's (bfloat16), got {out.dtype}"
    torch.testing.assert_close(out.float(), attention_oracle(q, k, v, True), atol=2e-2, rtol=2e-2)


@pytest.mark.task_00_attention
def test_attention_matches_sdpa():
    check_attention(impl.naive_attention)
    banned = ["scaled_dot_product_attention", "sdpa_attention", "multi_head_attention_forward", "minillm"]
    for fn in (impl.naive_attention, impl.causal_mask, impl.repeat_kv):
        forbid_calls(fn, banned)


@pytest.mark.task_00_attention
@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 2), hkv=st.integers(1, 3), group=st.integers(1, 3), q_len=st.integers(1, 9),
       extra=st.integers(0, 9), d=st.sampled_from([4, 8, 32]))
def test_attention_any_shape(b, hkv, group, q_len, extra, d):
    g = _gen(b * 1000 + hkv * 100 + group * 10 + q_len + extra)
    q = torch.randn(b, hkv * group, q_len, d, generator=g)
    k, v = torch.randn(b, hkv, q_len + extra, d, generator=g), torch.randn(b, hkv, q_len + extra, d, generator=g)
    torch.testing.assert_close(impl.naive_attention(q, k, v, causal=True), attention_oracle(q, k, v, True),
                               atol=1e-5, rtol=1e-4)


@pytest.mark.task_00_attention
def test_causal_mask_and_repeat_kv():
    for q_len, kv_len in [(1, 1), (4, 4), (1, 6), (3, 7)]:
        expected = torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=kv_len - q_len)
        mask = impl.causal_mask(q_len, kv_len)
        assert mask.dtype == torch.bool and torch.equal(mask, expected), f"causal_mask({q_len}, {kv_len}) is wrong"
    x = torch.randn(2, 3, 5, 4)
    for group in (1, 2, 3):
        torch.testing.assert_close(impl.repeat_kv(x, group), x.repeat_interleave(group, dim=1))


def _attention(mask_fn, kv_layout: str = "interleave", scale: bool = True):
    """A naive attention with one mistake plugged in (for the grader's self-test)."""

    def attention(q, k, v, causal=True):
        group = q.shape[1] // k.shape[1]
        if kv_layout == "interleave":
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        else:  # tiled: query head h reads KV head h % n_kv_heads instead of h // group
            k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
        scores = q.float() @ k.float().transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale else 1.0)
        if causal:
            scores = scores.masked_fill(~mask_fn(q.shape[2], k.shape[2]), float("-inf"))
        return (scores.softmax(-1) @ v.float()).to(q.dtype)

    return attention


def _right_mask(q_len, kv_len):
    return torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=kv_len - q_len)


def _mask_off_by_one(q_len, kv_len):  # a query may not see itself
    return torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=kv_len - q_len - 1)


def _mask_top_left(q_len, kv_len):  # torch's is_causal convention: wrong once q_len < kv_len
    return torch.ones(q_len, kv_len, dtype=torch.bool).tril()


@grader_selftest
def test_attention_grader_accepts_a_right_variant():
    check_attention(_attention(_right_mask))  # so the mistakes below are what gets caught


@grader_selftest
@pytest.mark.parametrize("wrong", [_attention(_mask_off_by_one), _attention(_mask_top_left),
                                   _attention(_right_mask, kv_layout="tile"), _attention(_right_mask, scale=False)],
                         ids=["mask_off_by_one", "mask_top_left", "gqa_tiled", "no_scale"])
def test_attention_grader_rejects_wrong_answers(wrong):
    with pytest.raises(AssertionError):
        check_attention(wrong)


# ================================================================================================= task 00.sampler


def nucleus_oracle(logits: list[float], temperature: float, top_k: int | None, top_p: float) -> list[float]:
    """The distribution to sample from, in plain Python: softmax(logits / T), keep the k most likely, renormalise,
    keep the shortest most-likely prefix whose mass reaches top_p (at least one token), renormalise."""
    m = max(logits)
    weights = [math.exp((x - m) / temperature) for x in logits]
    probs = [w / sum(weights) for w in weights]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept = order[:top_k] if top_k is not None else order
    mass = sum(probs[i] for i in kept)
    chosen, acc = [], 0.0
    for i in kept:
        chosen.append(i)
        acc += probs[i] / mass
        if acc >= top_p:
            break
    total = sum(probs[i] for i in chosen)
    return [probs[i] / total if i in chosen else 0.0 for i in range(len(probs))]


def sampled_frequencies(fn, logits: torch.Tensor, n: int, seed: int, **kw) -> torch.Tensor:
    """Draw n samples in one batched call (n identical rows) with a seeded generator; return frequencies."""
    ids = fn(logits[None].expand(n, -1).contiguous(), generator=_gen(seed), **kw)
    assert ids.shape == (n,), f"expected shape ({n},), got {tuple(ids.shape)}"
    assert ids.dtype == torch.long, f"token ids must be int64, got {ids.dtype}"
    return torch.bincount(ids, minlength=logits.shape[0]).double() / n


def _logits_from_probs(probs: list[float], order: list[int]) -> torch.Tensor:
    """Logits whose softmax is `probs`, placed at shuffled positions so that index order != probability order."""
    out = torch.empty(len(probs))
    for p, i in zip(probs, order):
        out[i] = math.log(p)
    return out


def check_sampler(fn) -> None:
    g = _gen(3)
    # temperature 0 is argmax, row by row
    logits = torch.randn(6, 100, generator=g)
    greedy = fn(logits, temperature=0.0)
    assert greedy.shape == (6,), f"expected shape (6,), got {tuple(greedy.shape)}"
    assert torch.equal(greedy, logits.argmax(-1)), "temperature 0 must return the argmax of each row"
    # rows are independent: top_k=1 gives each row's own argmax
    assert torch.equal(fn(logits, temperature=1.0, top_k=1, generator=_gen(0)), logits.argmax(-1)), \
        "top_k=1 must return each row's argmax (filter per row, not across the batch)"

    n = 20_000  # a frequency's standard deviation is at most 0.0035: the 0.02 tolerance is ~6 sigma
    probs = [0.5, 0.3, 0.15, 0.04, 0.01]
    nucleus_logits = _logits_from_probs(probs, [3, 0, 4, 1, 2])
    random_logits = torch.randn(40, generator=g) * 2
    cases = [  # (logits, temperature, top_k, top_p)
        (random_logits, 1.0, None, 1.0),  # plain sampling
        (random_logits, 1.0, 5, 1.0),  # top-k: never outside the 5 largest
        (random_logits, 2.5, 8, 1.0),  # temperature flattens before top-k
        (nucleus_logits, 1.0, None, 0.7),  # 0.5 < 0.7 <= 0.8: the token crossing the threshold stays
        (nucleus_logits, 1.0, None, 0.9),
        (nucleus_logits, 1.0, None, 0.01),  # tiny p: still one token
        (nucleus_logits, 2.0, None, 0.7),  # temperature applies before the nucleus is chosen
        (random_logits, 0.8, 10, 0.6),  # top-k, then top-p over the renormalised top k
    ]
    for seed, (lg, t, k, p) in enumerate(cases):
        expected = torch.tensor(nucleus_oracle(lg.tolist(), t, k, p), dtype=torch.float64)
        freq = sampled_frequencies(fn, lg, n, seed, temperature=t, top_k=k, top_p=p)
        outside = (freq > 0) & (expected == 0)
        assert not outside.any(), (f"temperature={t}, top_k={k}, top_p={p}: sampled tokens "
                                   f"{outside.nonzero().flatten().tolist()} that should have been filtered out")
        worst = (freq - expected).abs().max().item()
        assert worst < 0.02, (f"temperature={t}, top_k={k}, top_p={p}: sampled frequencies differ from the "
                               f"expected distribution by up to {worst:.3f}\n expected {expected.tolist()}\n "
                               f"got {freq.tolist()}")
    # large logits: a shift by 1000 changes nothing in softmax, but exp(1000) overflows float32
    freq = sampled_frequencies(fn, random_logits + 1000.0, n, 99, temperature=1.0, top_k=None, top_p=1.0)
    expected = torch.tensor(nucleus_oracle(random_logits.tolist(), 1.0, None, 1.0), dtype=torch.float64)
    assert (freq - expected).abs().max() < 0.02, (
        "logits shifted by +1000 must sample like the unshifted ones: subtract the max before exp")
    # a temperature of 1e-300 is 0 in float32: dividing raw logits by it gives +-inf and softmax NaN; greedy's limit
    try:
        tiny = fn(logits, temperature=1e-300, generator=_gen(5))
    except RuntimeError as e:
        raise AssertionError(f"temperature=1e-300 raised ({e}): shift the logits by their max before dividing, "
                             "and divide by at least float32's smallest normal: a tiny temperature tends to greedy"
                             ) from e
    assert torch.equal(tiny, logits.argmax(-1)), (
        "temperature=1e-300 must pick each row's argmax (greedy's limit), got other tokens")
    # the top-p boundary, exactly: four equal logits are 0.25 each (exact in float32); with top_p=0.5 the first two
    # sorted tokens already reach p, so exactly two tokens survive (a strict '>' keeps a third)
    ids = fn(torch.zeros(4000, 4), temperature=1.0, top_p=0.5, generator=_gen(11))
    kept = sorted(set(ids.tolist()))
    assert len(kept) == 2, (f"four tokens of probability 0.25 with top_p=0.5: the smallest set reaching 0.5 has 2 "
                            f"tokens, sampled {len(kept)} distinct ({kept}); a token is dropped once the mass "
                            f"before it is >= top_p")
    # the same seed gives the same tokens
    a = fn(random_logits[None].expand(64, -1), temperature=1.0, generator=_gen(7))
    b = fn(random_logits[None].expand(64, -1), temperature=1.0, generator=_gen(7))
    assert torch.equal(a, b), "sampling with the same seeded generator must repeat exactly"


@pytest.mark.task_00_sampler
def test_sampler_distributions():
    check_sampler(impl.sample_from_logits)
    forbid_calls(impl.sample_from_logits, ["minillm", "TopPLogitsWarper", "TopKLogitsWarper"])


def _sampler(top_p_rule: str = "right", temperature_first: bool = True, top_k_keep: str = "right",
             shift: bool = True):
    """A sampler with one mistake plugged in (for the grader's self-test)."""

    def sample(logits, temperature=0.0, top_k=None, top_p=1.0, generator=None):
        if temperature == 0:
            return logits.argmax(-1)
        logits = logits.float()
        if shift:
            logits = logits - logits.amax(-1, keepdim=True)
        if temperature_first:
            logits = logits / (max(temperature, torch.finfo(torch.float32).tiny) if shift else temperature)
        if top_k is not None:
            kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits <= kth if top_k_keep == "off_by_one" else logits < kth, float("-inf"))
        if top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(-1)
            cum = probs.cumsum(-1)
            if top_p_rule == "right":
                drop = cum - probs >= top_p
            else:  # keep only while the running mass stays below p: loses the token that crosses it
                drop = cum > top_p
                drop[:, 0] = False
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order,
                                                                    sorted_logits.masked_fill(drop, -math.inf))
        if not temperature_first:
            logits = logits / temperature
        return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)

    return sample


@grader_selftest
def test_sampler_grader_accepts_a_right_variant():
    check_sampler(_sampler())  # so the mistakes below are what gets caught


@grader_selftest
@pytest.mark.parametrize("wrong", [_sampler(top_p_rule="drops_crossing_token"), _sampler(temperature_first=False),
                                   _sampler(top_k_keep="off_by_one"), _sampler(shift=False)],
                         ids=["top_p_drops_crossing_token", "temperature_after_filtering", "top_k_off_by_one",
                              "tiny_temperature_unshifted"])
def test_sampler_grader_rejects_wrong_answers(wrong):
    with pytest.raises((AssertionError, RuntimeError)):  # nan probabilities raise
        check_sampler(wrong)


# ===================================================================================== the real model, your decoder


@pytest.mark.task_00_real_model
def test_your_decoder_runs_smollm2(real_model):
    """Your rms_norm, apply_rope, naive_attention (as the model's attention backend) and sample_from_logits inside
    SmolLM2-135M (float32): the chat prompt's logits within 1e-3 of the reference's, one piece at a time and all
    together, then `minillm.chat` answers "The capital of France is Paris." (minillm.course.seams.use_exercises)."""
    import minillm
    from minillm.course.seams import use_exercises
    from tests.graders.real_model import ANSWER, PROMPT, chat_ids, one_thread, reference_logits

    model, tok = real_model
    want = reference_logits(model, tok)
    x = torch.tensor([chat_ids(tok)])
    for only in ({"rms_norm"}, {"apply_rope"}, {"naive_attention"}, None):
        with use_exercises(model, impl, only=only), torch.inference_mode():
            got = one_thread(model)(x)
        what = f"with your {next(iter(only))} in SmolLM2 (the rest: minillm's)" if only else "with all your pieces"
        assert got.shape == want.shape and torch.isfinite(got).all(), f"{what}: logits are not finite"
        err = (got - want).abs().max().item()
        assert err <= 1e-3, f"{what}: the chat prompt's logits differ from the reference by up to {err:.3g} (> 1e-3)"
    with use_exercises(model, impl):
        out = one_thread(minillm.chat)(model, tok, PROMPT, max_new_tokens=12)
    assert out.text.strip() == ANSWER, f"SmolLM2 on your decoder answered {out.text!r}, expected {ANSWER!r}"
