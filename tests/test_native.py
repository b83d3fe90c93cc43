"""The native step (minillm/compile/native.py, kernels/cpu/native_step.cpp) against the eager layers it replaces.

Oracle: the same model with native_step=None (eager torch over the same low-bit kernels). Both quantize activations
to int8 per block of 32, so a last-bit difference upstream can move a code: the tiny models are compared within a
tolerance far below what a wrong RoPE, mask, cache slot or head mapping gives (checked by mutants in
test_native_catches_a_wrong_position), and the real model by greedy tokens with near-ties stated.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.api import make_cache
from minillm.cache.paged import Chunk, PackedForward, PagedKVCache
from minillm.compile.native import cache_layout, enable_native, why_not_native
from minillm.compress.quant import cpu_kernels
from minillm.compress.quantize import quantize
from tests.conftest import tiny_model

pytestmark = [pytest.mark.skipif(cpu_kernels() is None, reason="the CPU low-bit kernels did not build here"),
              pytest.mark.usefixtures("one_thread")]

# Logits of the tiny models are O(1). Measured over 48 runs (2 sequences, 30 + 4 tokens): native vs eager differ by
# at most 0.041 and on average by at most 1.1e-3, where an int8 activation code flipped (hypothesis later found a
# 5-token int8/int8-KV case at 3.2e-3); a wrong position or slot moves them by O(0.1-1) on average
# (test_native_catches_a_wrong_position)
MEAN_TOL, MAX_TOL = 6e-3, 0.2
TINY_LOGIT_STD = 8.5  # the default tiny models' logits (measured), which the tolerances above were measured on


def assert_close_within_int8_rounding(native, eager):
    """Within the tolerances, scaled up for a model whose logits spread wider than the default tiny ones (the
    head_dim-64 shape's are ~16: its rounding moves them proportionally more)."""
    d, scale = (native - eager).abs(), max(1.0, float(eager.std()) / TINY_LOGIT_STD)
    assert d.mean() <= MEAN_TOL * scale and d.max() <= MAX_TOL * scale, f"mean {d.mean():.2e}, max {d.max():.3f}"


def quantized_tiny(scheme: str = "int4", seed: int = 0, **cfg):
    model = tiny_model(seed, **cfg)
    quantize(model, scheme, group_size=32, include_head=False)
    return model


def both(model, run, native_run=None):
    """run(model) with the eager layers, then native_run (default: run) with the native step: (eager, native)."""
    model.native_step = None
    with torch.inference_mode():
        eager = run(model)
    enable_native(model)
    with torch.inference_mode():
        native = (native_run or run)(model)
    model.native_step = None
    return eager, native


def decode_run(kind: str, kv_dtype, batch: int, prompt: int, steps: int, seed: int):
    def run(model):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=g)
        cache = make_cache(kind, model, prompt + steps, batch_size=batch, kv_dtype=kv_dtype)
        out = [model(ids, kv_cache=cache)]  # every prompt row's logits: prefill attends causally inside the step
        for _ in range(steps):
            nxt = torch.randint(0, model.config.vocab_size, (batch, 1), generator=g)  # teacher-forced: same inputs
            out.append(model(nxt, kv_cache=cache))
        return torch.cat(out, dim=1)
    return run


@settings(max_examples=24, deadline=None)
@given(kind=st.sampled_from(["contiguous", "paged"]), int8_kv=st.booleans(), scheme=st.sampled_from(["int4", "int8"]),
       batch=st.integers(1, 3), prompt=st.integers(1, 40), steps=st.integers(0, 5), seed=st.integers(0, 99),
       smollm_heads=st.booleans())
def test_native_matches_eager_on_every_cache(kind, int8_kv, scheme, batch, prompt, steps, seed, smollm_heads):
    """The oracle runs the contiguous cache (paged equals contiguous): with an int8 cache its eager path attends to
    keys read back from int8 as the native step does, where the eager paged prefill attends to the new float ones.
    smollm_heads: head_dim 64 in groups of 3, as SmolLM2 (the SIMD attention kernels' shapes, values_by_group's)."""
    model = quantized_tiny(scheme, seed % 3, **(dict(dim=192, n_heads=3, n_kv_heads=1) if smollm_heads else {}))
    kv_dtype = torch.int8 if int8_kv else None
    eager, native = both(model, decode_run("contiguous", kv_dtype, batch, prompt, steps, seed),
                         decode_run(kind, kv_dtype, batch, prompt, steps, seed))
    assert native.shape == eager.shape
    assert_close_within_int8_rounding(native, eager)


def packed_run(specs, seed):
    """One engine step over sequences in any mix: (context already cached, new tokens, logits wanted)."""
    def run(model):
        g = torch.Generator().manual_seed(seed)
        cache = PagedKVCache(model.config, num_blocks=64, block_size=8)
        forward = PackedForward(model, cache)
        tables, chunks = [], []
        for cached, new, _ in specs:
            ids = cache.allocator.allocate(-(-(cached + new) // 8))
            tables.append(ids)
            if cached:  # fill the context first, one prompt step per sequence
                forward([Chunk(ids, 0, torch.randint(0, 512, (cached,), generator=g).tolist())])
        for table, (cached, new, n_logits) in zip(tables, specs):
            chunks.append(Chunk(table, cached, torch.randint(0, 512, (new,), generator=g).tolist(), n_logits))
        return forward(chunks)
    return run


@settings(max_examples=10, deadline=None)
@given(specs=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 6)), min_size=1, max_size=4),
       seed=st.integers(0, 99), float_weights=st.booleans())
def test_native_engine_step_mixes_decodes_verifies_and_chunks(specs, seed, float_weights):
    """One packed forward: decodes (1 new token), verifies (a few, every row's logits) and prompt chunks; on 4-bit
    weights within the int8 rounding, on float32 ones to float32 summation order."""
    specs = [(cached, new, new if new > 1 and i % 2 else 1) for i, (cached, new) in enumerate(specs)]
    model = tiny_model(seed % 2) if float_weights else quantized_tiny("int4", seed % 2)
    eager, native = both(model, packed_run(specs, seed))
    if float_weights:
        assert (native - eager).abs().mean() <= 2e-5 * max(1.0, float(eager.std()))
    else:
        assert_close_within_int8_rounding(native, eager)


def test_native_catches_a_wrong_position():
    """The tolerance can fail: the same step with every position off by one (a RoPE / cache-slot bug) moves the
    logits by 0.37 on average, 60x the tolerance."""
    model = quantized_tiny("int4")
    ids = torch.randint(0, 512, (1, 12))
    with torch.inference_mode():
        eager = model(ids, kv_cache=make_cache("contiguous", model, 16))
        enable_native(model)
        cache = make_cache("contiguous", model, 16)
        h = model.embed_tokens(ids)
        pos = cache.begin_forward(1, 12, None)
        shifted = model.logits(model.native_step(h, (pos + 1).expand(1, 12), cache))
    model.native_step = None
    assert (shifted - eager).abs().mean() > 10 * MEAN_TOL


def test_native_falls_back_where_it_cannot_run():
    model = quantized_tiny("int4")
    enable_native(model)
    ids = torch.randint(0, 512, (1, 5))
    h = model.embed_tokens(ids)
    assert model.native_step(h, torch.arange(5)[None], None) is None  # no cache: the recompute baseline stays eager
    with torch.no_grad():
        cache = make_cache("contiguous", model, 8)
        cache.begin_forward(1, 5, None)
        assert model.native_step(h, torch.arange(5)[None], cache) is not None
    h = model.embed_tokens(ids)
    assert model.native_step(h, torch.arange(5)[None], cache) is None  # autograd on: eager
    assert cache_layout(object(), 1, 5, 2) is None  # a cache the step does not know
    chosen = PagedKVCache(model.config, num_blocks=4, block_size=8, decode_backend="gather")
    assert cache_layout(chosen, 1, 5, 2) is None  # a decode backend chosen by name is honoured: eager


def test_native_refuses_models_it_cannot_run_and_says_why():
    biased = tiny_model()
    biased.layers[1].mlp.down = torch.nn.Linear(biased.config.ffn_dim, biased.config.dim, bias=True)
    assert "layer 1's down projection is Linear" in why_not_native(biased)
    with pytest.raises(ValueError, match="weights='q4' or 'int8'"):
        enable_native(biased)
    assert biased.native_step is None
    half = tiny_model().to(torch.bfloat16)
    assert "float32 activations" in why_not_native(half)


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(["contiguous", "paged"]), int8_kv=st.booleans(), batch=st.integers(1, 3),
       prompt=st.integers(1, 40), steps=st.integers(0, 5), seed=st.integers(0, 99), smollm_heads=st.booleans())
def test_native_float32_weights_match_eager_to_float_rounding(kind, int8_kv, batch, prompt, steps, seed,
                                                              smollm_heads):
    """float32 weights read as they lie (f32_matmul.cpp, the LM head too): nothing is quantized but an int8 cache,
    so the native logits equal eager's to float32 summation order. Measured over 48 runs, the mean difference over
    the logits' std: <= 1.8e-7 (float cache), 1.6e-5 (int8 cache, a last-bit change can move a code); a position off
    by one moves it by 4.4e-2 (test_native_catches_a_wrong_position's case)."""
    model = tiny_model(seed % 3, **(dict(dim=192, n_heads=3, n_kv_heads=1) if smollm_heads else {}))
    assert why_not_native(model) is None
    kv_dtype = torch.int8 if int8_kv else None
    eager, native = both(model, decode_run("contiguous", kv_dtype, batch, prompt, steps, seed),
                         decode_run(kind, kv_dtype, batch, prompt, steps, seed))
    tol = 1e-4 if int8_kv else 2e-5
    d = (native - eager).abs()
    assert d.mean() <= tol * max(1.0, float(eager.std())), (d.mean(), d.max())


def test_native_step_checks_its_input():
    model = quantized_tiny("int4")
    enable_native(model)
    decoder = model.native_step.decoder
    h, pos = torch.zeros(1, 64), torch.tensor([3])
    k = torch.zeros(2, 4, 8, 2, 16)  # (layers, blocks, block_size, n_kv, D)
    strides = [k.stride(0), k.stride(2), k.stride(3), 0, 0, 0]
    seq, e = torch.zeros(1, dtype=torch.int32), torch.empty(0, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        decoder.step(h, pos, seq, torch.tensor([[9]], dtype=torch.int32), 8, k, k.clone(), e, e, strides, 1)
    with pytest.raises(RuntimeError, match="past the RoPE tables"):
        decoder.step(h, torch.tensor([10 ** 6]), seq, torch.tensor([[0]], dtype=torch.int32), 8, k, k.clone(), e, e,
                     strides, 1)
    with pytest.raises(RuntimeError, match="h must be"):
        decoder.step(torch.zeros(1, 63), pos, seq, torch.tensor([[0]], dtype=torch.int32), 8, k, k.clone(), e, e,
                     strides, 1)
    decoder.step(h, pos, seq, torch.tensor([[0]], dtype=torch.int32), 8, k, k.clone(), e, e, strides, 1)  # fine


@settings(max_examples=14, deadline=None)
@given(kind=st.sampled_from(["contiguous", "paged"]), int8_kv=st.booleans(), prompt=st.integers(1, 30),
       k=st.integers(1, 16), seed=st.integers(0, 99), float_weights=st.booleans())
def test_a_verify_step_equals_its_decode_steps_bit_for_bit(kind, int8_kv, prompt, k, seed, float_weights):
    """Speculative decoding is exactly the target's greedy output only if a forward over k new tokens gives each
    position the logits k one-token steps give it: the attention of a several-token run must do the same arithmetic
    per (row, key) as a single token's (kernels/cpu/native_step.cpp scores_by_key, values_by_row), and so must the
    matmuls (integer sums; a float32 weight's sums in one order, f32_matmul.cpp, the LM head too)."""
    model = tiny_model(0, dim=384, n_heads=6, n_kv_heads=2)  # head_dim 64 in groups of 3, as SmolLM2
    if not float_weights:  # the LM head on the kernels too (torch's 1-row and k-row matmuls are different calls)
        quantize(model, "int4", group_size=32, include_head=True)
    enable_native(model)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt + k), generator=g)
    kv = torch.int8 if int8_kv else None
    with torch.inference_mode():
        one = make_cache(kind, model, prompt + k, kv_dtype=kv)
        model(ids[:, :prompt], kv_cache=one)
        verify = model(ids[:, prompt:], kv_cache=one)
        each = make_cache(kind, model, prompt + k, kv_dtype=kv)
        model(ids[:, :prompt], kv_cache=each)
        steps = torch.cat([model(ids[:, prompt + i:prompt + i + 1], kv_cache=each) for i in range(k)], dim=1)
    assert torch.equal(verify, steps), (verify - steps).abs().max()


@settings(max_examples=6, deadline=None)
@given(int8_kv=st.booleans(), prompt=st.integers(100, 300), k=st.integers(1, 8), seed=st.integers(0, 99))
def test_a_verify_step_equals_its_decode_steps_at_long_contexts_on_two_threads(int8_kv, prompt, k, seed):
    """Past 64 keys the attention splits a context over tasks (the flash-decoding split); the cuts sit at fixed
    key positions, so a 1-token and a (k+1)-token run merge the same partial sums, on any number of threads."""
    model = tiny_model(0, dim=384, n_heads=6, n_kv_heads=2)
    quantize(model, "int4", group_size=32, include_head=True)
    enable_native(model)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt + k), generator=g)
    kv = torch.int8 if int8_kv else None
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            one = make_cache("paged", model, prompt + k, kv_dtype=kv)
            model(ids[:, :prompt], kv_cache=one)
            verify = model(ids[:, prompt:], kv_cache=one)
            each = make_cache("paged", model, prompt + k, kv_dtype=kv)
            model(ids[:, :prompt], kv_cache=each)
            steps = torch.cat([model(ids[:, prompt + i:prompt + i + 1], kv_cache=each) for i in range(k)], dim=1)
            torch.set_num_threads(1)
            each = make_cache("paged", model, prompt + k, kv_dtype=kv)
            model(ids[:, :prompt], kv_cache=each)
            alone = torch.cat([model(ids[:, prompt + i:prompt + i + 1], kv_cache=each) for i in range(k)], dim=1)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(verify, steps), (verify - steps).abs().max()
    assert torch.equal(steps, alone), (steps - alone).abs().max()  # one thread or two: the same partial sums


def test_native_survives_a_cast_and_threads_agree():
    model = quantized_tiny("int8")
    enable_native(model)
    step = model.native_step
    model.float()  # _apply: rebuilt over the (same) tensors, still native
    assert model.native_step is not None and model.native_step is not step
    run = decode_run("paged", None, 2, 9, 3, 1)
    with torch.inference_mode():
        one = run(model)
        torch.set_num_threads(2)
        try:
            two = run(model)
        finally:
            torch.set_num_threads(1)
    torch.testing.assert_close(one, two, atol=1e-5, rtol=0)  # threads split whole groups: the same sums


def test_native_real_model_agrees_with_eager_within_the_int8_noise():
    """SmolLM2 q4, a chat prompt and 48 of its own greedy tokens, teacher-forced. Both paths round activations to int8
    per block of 32, which makes the logits chaotic at the last bit: eager against eager with its embeddings scaled
    by (1 + 1e-7 * noise) differs by 0.22 on average (measured on this prompt), native against eager by 0.20. So:
    the mean difference stays at that floor, top-1 agrees at >= 85% of positions, and only where eager's own top-2
    margin is below 0.5 (a near-tie inside the noise)."""
    from minillm.api import load_model

    model, tok = load_model(weights="q4", fuse=True)
    prompt = tok.encode_chat([{"role": "user", "content": "Write a short story about a lighthouse keeper."}])
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        for _ in range(48):  # eager greedy continuation
            ids = torch.cat([ids, model(ids, last_only=True)[:, -1].argmax(-1, keepdim=True)], dim=1)
    full = lambda m: m(ids, kv_cache=make_cache("paged", m, ids.shape[1]))[0, len(prompt) - 1:-1]  # noqa: E731
    eager, native = both(model, full)
    d = (native - eager).abs()
    top2 = eager.topk(2).values
    margin = top2[:, 0] - top2[:, 1]
    differ = eager.argmax(-1) != native.argmax(-1)
    assert d.mean() < 0.35, d.mean()
    assert differ.float().mean() <= 0.15 and (margin[differ] < 0.5).all(), (differ.sum(), margin[differ])


def test_breakdown_splits_the_native_call_by_its_own_clock():
    """The profiler sees one op for every layer of a native step; the breakdown charges it by the C++ stage clock."""
    from minillm.compile import native
    from minillm.measure.breakdown import step_breakdown

    model = quantized_tiny("int4")
    enable_native(model)
    before = native.STAGE_SECONDS["total"]
    b = step_breakdown(model, "decode", context=32, repeat=2)
    model.native_step = None
    assert native.STAGE_SECONDS["total"] > before
    assert b.terms["matmul"] > 0 and b.terms["attention"] > 0 and b.terms["elementwise"] > 0
    assert b.n_ops < 60  # the eager tiny model dispatches hundreds: the native call is not an aten op


def test_breakdown_charges_a_float32_native_head_to_matmul():
    """A float32 LM head runs f32_matmul from Python (no aten op): its profiler scope is charged to "matmul", not to
    the Python/dispatch term. Oracle: the same step with the head's scope renamed lands that time in "else"."""
    from minillm.compile import native
    from minillm.measure.breakdown import step_breakdown

    model = tiny_model(0, vocab_size=32768)  # a head large enough to time: 32768 x 64 floats
    enable_native(model)
    head = model.native_step.head
    calls = []
    model.native_step.head = lambda h, w: calls.append(1) or head(h, w)
    b = step_breakdown(model, "decode", context=16, repeat=3)
    assert calls and b.terms["matmul"] > b.terms["else"], b.terms
    native_head, native.HEAD_SCOPE = native.HEAD_SCOPE, "not a charged scope"
    try:
        renamed = step_breakdown(model, "decode", context=16, repeat=3)
    finally:
        native.HEAD_SCOPE = native_head
        model.native_step = None
    assert renamed.terms["matmul"] < b.terms["matmul"] / 2, (renamed.terms, b.terms)


def test_a_layer_replaced_after_enable_native_is_what_runs(capsys):
    """The step must never run the weights a model held when it was built: a Linear or a weight replaced afterwards
    is picked up (rebuilt, still native), and a layer the step cannot run hands the forward to eager, said once."""
    model = tiny_model(0)
    enable_native(model)
    ids = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(0))

    def forward():
        with torch.inference_mode():
            return model(ids, kv_cache=make_cache("contiguous", model, 8))

    def eager():
        step, model.native_step = model.native_step, None
        try:
            return forward()
        finally:
            model.native_step = step

    before = forward()
    model.layers[0].mlp.down = torch.nn.Linear(model.config.ffn_dim, model.config.dim, bias=False)
    replaced = forward()
    assert not torch.allclose(replaced, before) and model.native_step.off is None
    assert (replaced - eager()).abs().max() < 1e-4
    model.layers[1].attn.wo.weight = torch.nn.Parameter(torch.zeros_like(model.layers[1].attn.wo.weight))
    assert (forward() - eager()).abs().max() < 1e-4
    model.layers[1].mlp.down = torch.nn.Linear(model.config.ffn_dim, model.config.dim, bias=True)  # not native
    torch.testing.assert_close(forward(), eager())
    torch.testing.assert_close(forward(), eager())
    err = capsys.readouterr().err
    assert err.count("was replaced after enable_native") == 1 and "down projection" in err, err
    assert model.native_step.off is not None
