"""The seams later lessons plug into, each used the way its lesson will use it (issue: seams for the second half).

Every check compares against an independent path: the no-cache forward, a fresh cache that never saw the rolled-back
tokens, the unmodified model, SDPA / logsumexp over the full score matrix, or the engine's own non-streaming answer.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import minillm
from minillm.attention import backend_names, get_attention, register_attention
from minillm.config import ModelConfig
from minillm.attention.flash import flash_attention, merge_partials
from minillm.kv_cache import KVCache
from minillm.cache.kv_transfer import pack_kv_blocks, unpack_kv_blocks
from minillm.model import Transformer, model_bytes, replace_linears
from minillm.cache.kv_pool import KVBlockPool, KVCacheSpec
from minillm.cache.paged import PagedSequenceCache
from minillm.sampling import SamplingParams, argmax_rows, logits_to_probs, sample_batch
from tests.conftest import tiny_model

CACHES = {"contiguous": KVCache.for_model, "paged": lambda m, b, n: PagedSequenceCache.for_model(m, b, n, block_size=4)}


def decode_logits(model, cache, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Prefill ids[:, :prompt_len], then one token per step; the logits of every position, concatenated."""
    outs = [model(ids[:, :prompt_len], kv_cache=cache)]
    outs += [model(ids[:, t:t + 1], kv_cache=cache) for t in range(prompt_len, ids.shape[1])]
    return torch.cat(outs, dim=1)


# ------------------------------------------------------------------------------------------------- the model


@pytest.mark.parametrize("kind", CACHES)
def test_drop_a_block_then_generate(kind):
    """Structured pruning (lesson 08) removes blocks; the loop passes each block its index, so caches built for the
    pruned model line up, and cached decoding equals the pruned model's own no-cache forward."""
    model = tiny_model(1, n_layers=4)
    model.layers = nn.ModuleList(b for i, b in enumerate(model.layers) if i != 1)
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    cache = CACHES[kind](model, 2, 12)
    with torch.inference_mode():
        torch.testing.assert_close(decode_logits(model, cache, ids, 7), model(ids), atol=1e-5, rtol=1e-5)
    layers = cache.k.shape[0] if kind == "contiguous" else cache.k_pool.shape[0]
    assert layers == 3


def test_stages_compose_to_forward_and_expose_hidden_states():
    """embed_tokens -> run_layers over two slices (a 2-stage pipeline, lesson 11) -> logits == forward."""
    model = tiny_model(2, n_layers=4)
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(9)[None]
    with torch.inference_mode():
        hidden: list[torch.Tensor] = []
        full = model(ids, hidden_states=hidden)
        h = model.run_layers(model.embed_tokens(ids), pos, layers=slice(0, 2))
        torch.testing.assert_close(h, hidden[1])
        h = model.run_layers(h, pos, layers=slice(2, None))
        torch.testing.assert_close(model.logits(h), full)
    assert len(hidden) == 4


class Wrapped(nn.Module):
    """What a quantizer or a tensor-parallel shard swaps in: a module that computes its own matmul."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.register_buffer("w", linear.weight.detach().clone())

    def forward(self, x):
        return F.linear(x, self.w)


def test_replace_linears_keeps_logits_and_model_bytes_counts_buffers():
    model = tiny_model(3)
    ids = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        before = model(ids)
    bytes_before = model_bytes(model)
    names = replace_linears(model, lambda name, lin: Wrapped(lin) if name.startswith(("layers.0.", "layers.1.mlp"))
                            else None)
    assert names == ["layers.0.attn.wq", "layers.0.attn.wk", "layers.0.attn.wv", "layers.0.attn.wo",
                     "layers.0.mlp.gate", "layers.0.mlp.up", "layers.0.mlp.down",
                     "layers.1.mlp.gate", "layers.1.mlp.up", "layers.1.mlp.down"]
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), before, atol=0, rtol=0)
    # the weights moved from parameters to buffers: the bytes a forward reads are the same
    assert model_bytes(model) == bytes_before
    assert model_bytes(model) < sum(p.numel() * 4 for p in model.parameters()) + sum(
        b.numel() * 4 for b in model.buffers())  # RoPE tables are not weights


def test_tied_head_is_not_replaced_and_rope_stays_float32_through_casts():
    model = tiny_model(4)
    assert "lm_head" not in replace_linears(model, lambda name, lin: Wrapped(lin))
    cast = model.to(torch.bfloat16)
    assert cast.rope_cos.dtype == torch.float32 and cast.rope_sin.dtype == torch.float32
    cos = minillm.model.rope_tables(model.config.head_dim, model.config.max_seq_len, model.config.rope_theta)[0]
    assert torch.equal(cast.rope_cos, cos)


def test_explicit_head_dim():
    """A tensor-parallel shard keeps head_dim 64 with a third of the heads: head_dim is not dim // n_heads there."""
    cfg = ModelConfig.tiny(dim=64, n_heads=2, n_kv_heads=1, head_dim=48)
    model = Transformer(cfg).eval()
    assert model.layers[0].attn.wq.weight.shape == (96, 64)
    ids = torch.randint(0, 512, (1, 6))
    with torch.inference_mode():
        torch.testing.assert_close(decode_logits(model, KVCache.for_model(model, 1, 6), ids, 3), model(ids),
                                   atol=1e-5, rtol=1e-5)
    assert ModelConfig.tiny().with_(n_heads=8).head_dim == 8  # derived again when it was derived
    assert cfg.with_(n_heads=1, n_kv_heads=1).head_dim == 48  # kept when explicit


def test_decode_forward_has_no_graph_breaks():
    """torch.compile (lesson 06) needs a decode step dynamo can trace whole, with each kind of cache."""
    for kind, make in CACHES.items():
        model = tiny_model(5)
        cache = make(model, 1, 16)
        with torch.inference_mode():
            model(torch.randint(0, 512, (1, 5)), kv_cache=cache)
            explained = torch._dynamo.explain(model)(torch.randint(0, 512, (1, 1)), kv_cache=cache)
        assert explained.graph_break_count == 0, (kind, explained.break_reasons)
        torch._dynamo.reset()


# ----------------------------------------------------------------------------------------------------- caches


@pytest.mark.parametrize("kind", CACHES)
def test_truncate_then_redecode_equals_never_decoded(kind):
    """Speculative decoding (lesson 10) writes draft tokens, then rolls back the rejected ones."""
    model = tiny_model(6)
    gen = torch.Generator().manual_seed(3)
    prompt, drafts, real = (torch.randint(0, 512, (2, n), generator=gen) for n in (9, 6, 4))
    rolled, fresh = CACHES[kind](model, 2, 24), CACHES[kind](model, 2, 24)
    with torch.inference_mode():
        model(prompt, kv_cache=rolled)
        model(drafts, kv_cache=rolled)  # 6 rejected drafts crossing a block boundary
        rolled.truncate(9)
        if kind == "paged":
            assert all(len(t) == 3 for t in rolled.block_tables_host)
            assert rolled.allocator.num_used() == 6  # the drafts' blocks went back to the pool
        a = decode_logits(model, rolled, real, 1)
        model(prompt, kv_cache=fresh)
        b = decode_logits(model, fresh, real, 1)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="truncate to"):
        rolled.truncate(100)


@pytest.mark.parametrize("kv_dtype", [None, torch.int8])
def test_pack_unpack_blocks_then_decode_identically(kv_dtype):
    """Disaggregation (lesson 13) moves a request's KV blocks from the prefill engine's pool into the decode
    engine's, at other block ids; decoding there continues exactly as it would have at home."""
    model = tiny_model(7)
    ids = torch.randint(0, 512, (1, 14), generator=torch.Generator().manual_seed(4))
    home = PagedSequenceCache.for_model(model, 1, 16, block_size=4, kv_dtype=kv_dtype)
    away = PagedSequenceCache(model.config, 9, 4, model.dtype, kv_dtype=kv_dtype)
    away.allocator.allocate(3)  # other requests hold the first blocks there
    with torch.inference_mode():
        model(ids[:, :11], kv_cache=home)
        whole = len(home.block_tables_host[0]) * 4  # every block of the table (block_size 4)
        blocks = pack_kv_blocks(home.pool, home.block_tables_host[0], whole)
        table = away.allocator.allocate(len(home.block_tables_host[0]))
        unpack_kv_blocks(away.pool, table, blocks)
        away.block_tables_host, away.seq_len = [table], home.seq_len
        a = decode_logits(model, home, ids[:, 10:], 1)[:, 1:]
        b = decode_logits(model, away, ids[:, 10:], 1)[:, 1:]
    assert table != home.block_tables_host[0][: len(table)]
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(ValueError, match="must match"):
        unpack_kv_blocks(away.pool, table[:2], blocks)


def test_int8_kv_pool_roundtrip_error_is_small():
    """int8 storage with a scale per token and head (lesson 07): read back within half a quantization step."""
    spec = KVCacheSpec(n_layers=1, n_kv_heads=2, head_dim=16, num_blocks=4, block_size=4, kv_dtype=torch.int8)
    pool = KVBlockPool(spec)
    k, v = torch.randn(2, 6, 2, 16).unbind(0)
    slots = torch.tensor([3, 7, 0, 12, 13, 5])
    pool.write(0, slots, k, v)
    k2, v2 = pool.read(0, slots)
    step = k.abs().amax(-1, keepdim=True) / 127
    assert ((k2 - k).abs().le(step / 2 + 1e-6).all()
            and (v2 - v).abs().le(v.abs().amax(-1, keepdim=True) / 254 + 1e-6).all())
    assert spec.bytes_per_block() < KVCacheSpec(1, 2, 16, 4, 4).bytes_per_block() / 3


# -------------------------------------------------------------------------------------------------- attention


@settings(max_examples=15, deadline=None)
@given(q_len=st.integers(1, 12), extra=st.integers(0, 12), split=st.integers(0, 12), seed=st.integers(0, 99))
def test_flash_lse_merges_split_keys_exactly(q_len, extra, split, seed):
    """return_lse is what ring attention / split-KV decode need: attention over two parts of the keys, each with
    its log-sum-exp, merges into attention over all keys."""
    kv_len = 2 * q_len + extra  # both parts hold at least q_len keys (the backends' q_len <= kv_len rule)
    split = q_len + min(split, extra)
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(1, 4, q_len, 8, generator=g), torch.randn(1, 2, kv_len, 8, generator=g), \
        torch.randn(1, 2, kv_len, 8, generator=g)
    out, lse = flash_attention(q, k, v, causal=False, block_q=8, block_k=8, return_lse=True)
    scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2) / 8**0.5
    torch.testing.assert_close(lse, scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, enable_gqa=True), atol=1e-5, rtol=1e-5)
    parts = [flash_attention(q, k[:, :, s], v[:, :, s], causal=False, return_lse=True)
             for s in (slice(0, split), slice(split, None))]
    # measured from m = lse, a part's exp-sum is exactly 1, so (output, lse, 1) is its partial for merge_partials
    o, _m, l = merge_partials(parts[0][0], parts[0][1], torch.ones_like(parts[0][1]),
                             parts[1][0], parts[1][1], torch.ones_like(parts[1][1]))
    torch.testing.assert_close(o / l[..., None], out, atol=1e-5, rtol=1e-5)


def test_registry_resolves_once_and_names_kinds():
    model = tiny_model(8)
    calls = []

    def counting(q, k, v, causal=True):
        calls.append(q.shape)
        return minillm.attention.sdpa_attention(q, k, v, causal)

    register_attention("counting", counting)
    try:
        model.attn_backend = "counting"
        assert model.attn_backend == "counting" and "counting" in backend_names()
        with torch.inference_mode():
            model(torch.randint(0, 512, (1, 4)))
        assert len(calls) == model.config.n_layers
        assert "torch" in backend_names("paged_decode") and "torch" not in backend_names()
        with pytest.raises(ValueError, match="unknown dense attention backend 'torch'"):
            get_attention("torch")
    finally:
        minillm.attention._REGISTRY.pop("counting")


# --------------------------------------------------------------------------------------- sampling and requests


def test_logits_to_probs_and_sample_batch():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(5))
    greedy = logits_to_probs(logits, 0.0)
    assert torch.equal(greedy.argmax(-1), logits.argmax(-1)) and torch.equal(greedy.sum(-1), torch.ones(4))
    p = logits_to_probs(logits, 0.7, top_k=5)
    assert ((p > 0).sum(-1) == 5).all()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1, logprobs=True),
              SamplingParams(temperature=0.5, top_p=0.5), SamplingParams(temperature=0)]
    gens = [None, torch.Generator().manual_seed(1), None, None]
    tokens, logprobs = sample_batch(logits, params, gens)
    assert tokens[0] == int(logits[0].argmax()) and tokens[3] == int(logits[3].argmax())
    expected = logits.log_softmax(-1)[torch.arange(4), torch.tensor(tokens)]
    torch.testing.assert_close(torch.tensor(logprobs), expected)
    again, _ = sample_batch(logits[1:2], params[1:2], [torch.Generator().manual_seed(1)])
    assert again[0] == tokens[1]  # seeded rows are reproducible


def test_request_layer_rejects_bad_prompts_and_seeds_with_clear_errors():
    model = tiny_model(9)
    llm = minillm.LLM.from_model(model, None, num_blocks=16, block_size=4)
    for front in (lambda p, **kw: minillm.generate(model, None, p, max_new_tokens=2, **kw),
                  lambda p, **kw: llm.generate([p], SamplingParams(max_tokens=2, **kw))):
        with pytest.raises(TypeError, match="decode bytes"):
            front(b"hello")
        with pytest.raises(ValueError, match=r"ints in \[0, 512\)"):
            front([1, 2, 512])
        with pytest.raises(ValueError, match="seed must be"):
            front([1, 2], seed=2**70)
    assert not llm.has_unfinished()


def test_generate_and_engine_share_defaults_and_outputs():
    model = tiny_model(10)
    ids = [5, 9, 2, 7]
    a = minillm.generate(model, None, ids, max_new_tokens=6)
    b = minillm.LLM.from_model(model, None, num_blocks=16, block_size=4).generate([ids],
                                                                             SamplingParams(max_tokens=6))[0]
    assert type(a) is type(b) is minillm.RequestOutput
    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason == "length"


# ------------------------------------------------------------------------------------------------- the engine


def test_concurrent_streams_each_get_exactly_their_own_tokens():
    """A server (lesson 12) has one consumer per connection: 8 threads stream at once, two of them abort midway."""
    model = tiny_model(11)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 512, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 20, (8,), generator=gen)]
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0.8 if i % 2 else 0.0, seed=i) for i in range(8)]
    expected = [o.token_ids for o in minillm.LLM.from_model(model, None, num_blocks=64, block_size=4,
                                                              max_num_seqs=4).generate(prompts, params)]
    llm = minillm.LLM.from_model(model, None, num_blocks=64, block_size=4, max_num_seqs=4)
    got: dict[int, list] = {}
    aborted: dict[int, bool] = {}
    errors = []

    def consume(i: int) -> None:
        try:
            events = []
            for ev in llm.stream([prompts[i]], params[i]):
                events.append(ev)
                if i in (2, 5) and len(events) == 3:
                    # False when other consumers' steps already finished it: its tokens are all queued by then
                    aborted[i] = llm.abort(ev.request_id)
            got[i] = events
        except Exception as e:  # noqa: BLE001 - surfaced below: a thread's failure would otherwise vanish
            errors.append(e)

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for i in range(8):
        events = got[i]
        assert len({ev.request_id for ev in events}) == 1  # only its own request's events
        assert events[-1].finished and sum(ev.finished for ev in events) == 1
        tokens = [ev.token_id for ev in events if ev.token_id is not None]
        if aborted.get(i):  # tokens already queued before the abort still arrive, then the abort event
            assert events[-1].finish_reason == "abort" and len(tokens) >= 3 and tokens == expected[i][:len(tokens)]
        else:
            assert tokens == expected[i] and events[-1].finish_reason == "length"
    assert llm.num_free_blocks() == 64 and not llm.has_unfinished()


def test_interleaved_iterators_in_one_thread():
    """Two stream() iterators advanced by hand: each receives all of its tokens (the old engine lost them)."""
    model = tiny_model(12)
    llm = minillm.LLM.from_model(model, None, num_blocks=32, block_size=4)
    a = llm.stream([[1, 2, 3]], SamplingParams(max_tokens=5))
    b = llm.stream([[4, 5, 6, 7]], SamplingParams(max_tokens=7))
    got_a, got_b = [], []
    for _ in range(20):
        for it, got in ((a, got_a), (b, got_b)):
            ev = next(it, None)
            if ev is not None:
                got.append(ev.token_id)
    assert len(got_a) == 5 and len(got_b) == 7


@settings(max_examples=40, deadline=None)
@given(shape=st.sampled_from([(7,), (1, 50), (3, 9), (2, 2, 33)]), ties=st.booleans(), nan=st.booleans(),
       seed=st.integers(0, 2**16))
def test_argmax_rows_is_torch_argmax(shape, ties, nan, seed):
    """The numpy route of a greedy pick against torch.argmax (the oracle): the first index on a tie, a NaN counts
    as the largest; the same on a non-float32 tensor (torch's route)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if ties:
        x = x.round()  # many equal maxima
    if nan:
        x.view(-1)[torch.randint(0, x.numel(), (2,), generator=g)] = float("nan")
    want = x.argmax(dim=-1)
    got = argmax_rows(x)
    assert got.dtype == torch.long and torch.equal(got, want)
    assert torch.equal(argmax_rows(x.double()), x.double().argmax(dim=-1))
