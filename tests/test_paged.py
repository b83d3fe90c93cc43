"""The paged KV cache: torch paged attention vs SDPA, packed prefill/decode mixes, and whole-model equivalence with
the contiguous cache (tiny random models under hypothesis, the real model greedy)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import minillm
from minillm.config import ModelConfig
from minillm.kv_cache import KVCache
from minillm.model import Transformer
from minillm.cache.block_allocator import OutOfBlocksError, blocks_needed
from minillm.cache.paged import PagedKVCache, PagedSequenceCache
from minillm.cache.paged_attention import AttentionMetadata, paged_attention, paged_prefill_attention


def make_pool(context_lens, block_size, n_kv_heads, head_dim, seed, dtype=torch.float32, spare=3, junk=float("nan")):
    """Pools with the sequences' blocks at shuffled ids; every slot no sequence owns (unused blocks, the tail of a
    last block) holds `junk`, so reading past a sequence's length shows up as NaN. Returns pools, tables, and each
    sequence's keys/values in order for the oracle."""
    g = torch.Generator().manual_seed(seed)
    need = [blocks_needed(c, block_size) for c in context_lens]
    num_blocks = sum(need) + spare
    k_pool = torch.full((num_blocks, block_size, n_kv_heads, head_dim), junk, dtype=dtype)
    v_pool = k_pool.clone()
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(context_lens), max(need)), -1, dtype=torch.int32)
    seqs = []
    for i, (c, n) in enumerate(zip(context_lens, need)):
        ids, perm = perm[:n], perm[n:]
        tables[i, :n] = torch.tensor(ids)
        k = torch.randn(c, n_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(c, n_kv_heads, head_dim, generator=g).to(dtype)
        for p in range(c):
            k_pool[ids[p // block_size], p % block_size] = k[p]
            v_pool[ids[p // block_size], p % block_size] = v[p]
        seqs.append((k, v))
    return k_pool, v_pool, tables, seqs


def sdpa_over(q, k, v):
    """q (n_new, H, D) as the last n_new positions over k, v (ctx, Hkv, D); causal bottom-right, via SDPA."""
    n_new, ctx = q.shape[0], k.shape[0]
    mask = torch.arange(ctx)[None, :] <= torch.arange(n_new)[:, None] + (ctx - n_new)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None].float(), k.transpose(0, 1)[None].float(),
                                         v.transpose(0, 1)[None].float(), attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


shapes = st.tuples(st.sampled_from([(4, 1), (4, 2), (4, 4), (6, 2), (9, 3)]), st.sampled_from([1, 2, 4, 16]),
                   st.sampled_from([8, 16]))


@settings(max_examples=40, deadline=None)
@given(shapes=shapes, lens=st.lists(st.integers(1, 40), min_size=1, max_size=5), seed=st.integers(0, 2**16))
def test_paged_attention_matches_sdpa(shapes, lens, seed):
    (n_heads, n_kv_heads), block_size, head_dim = shapes
    k_pool, v_pool, tables, seqs = make_pool(lens, block_size, n_kv_heads, head_dim, seed)
    q = torch.randn(len(lens), n_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    out = paged_attention(q, k_pool, v_pool, tables, torch.tensor(lens))
    assert not out.isnan().any(), "a slot past a sequence's length (NaN there) leaked into the output"
    for i, (k, v) in enumerate(seqs):
        torch.testing.assert_close(out[i], sdpa_over(q[i:i + 1], k, v)[0], atol=2e-5, rtol=1e-4)


def test_paged_attention_gqa_mapping_is_h_div_group():
    # KV head j holds constant values j: query head h must read KV head h // group (not h % n_kv_heads)
    k_pool = torch.zeros(2, 4, 3, 8)
    v_pool = torch.arange(3.0)[None, None, :, None].expand(2, 4, 3, 8).clone()
    out = paged_attention(torch.randn(1, 9, 8), k_pool, v_pool, torch.tensor([[1, 0]]), torch.tensor([6]))
    torch.testing.assert_close(out[0, :, 0], torch.tensor([0.0, 0, 0, 1, 1, 1, 2, 2, 2]))


def test_paged_attention_bf16_close_to_fp32():
    k_pool, v_pool, tables, seqs = make_pool([5, 33], 16, 2, 16, seed=3, dtype=torch.bfloat16, junk=0.0)
    q = torch.randn(2, 4, 16).bfloat16()
    out = paged_attention(q, k_pool, v_pool, tables, torch.tensor([5, 33]))
    assert out.dtype == torch.bfloat16
    for i, (k, v) in enumerate(seqs):
        torch.testing.assert_close(out[i].float(), sdpa_over(q[i:i + 1], k, v)[0], atol=2e-2, rtol=2e-2)


@settings(max_examples=25, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(1, 30), st.integers(0, 30)), min_size=1, max_size=4),
       block_size=st.sampled_from([1, 4, 16]), seed=st.integers(0, 2**16))
def test_packed_prefill_and_decode_mix_matches_per_sequence_sdpa(seqs, block_size, seed):
    """Sequences with n_new new tokens after `cached` earlier ones (decode: n_new=1; prefill: cached=0; chunked
    prefill / recompute: both), packed into one batch, through PagedKVCache.attend and paged_prefill_attention."""
    n_heads, n_kv_heads, head_dim = 4, 2, 8
    query_lens = [n for n, _ in seqs]
    ctx = [n + c for n, c in seqs]
    k_pool, v_pool, tables, kv = make_pool(ctx, block_size, n_kv_heads, head_dim, seed)
    q = torch.randn(sum(query_lens), n_heads, head_dim, generator=torch.Generator().manual_seed(seed))
    starts = [sum(query_lens[:i]) for i in range(len(seqs))]
    expected = torch.cat([sdpa_over(q[s:s + n], k, v) for s, n, (k, v) in zip(starts, query_lens, kv)])
    out = paged_prefill_attention(q, k_pool, v_pool, tables, ctx, query_lens)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)

    # the same batch through the cache: write the new tokens' k/v via slot_mapping, attend (decode rows take the
    # batched fast path, the others the per-sequence path)
    cfg = ModelConfig.tiny(n_layers=1, n_heads=n_heads, n_kv_heads=n_kv_heads, dim=n_heads * head_dim)
    cache = PagedKVCache(cfg, k_pool.shape[0], block_size)
    cache.k_pool[0], cache.v_pool[0] = k_pool, v_pool
    tables_list = [[b for b in row if b >= 0] for row in tables.tolist()]
    for row in tables_list:
        for b in row:  # mark the blocks as owned
            cache.allocator._free.remove(b)
            cache.allocator._ref_counts[b] = 1
    meta = AttentionMetadata.build(tables_list, ctx, query_lens, block_size)
    new_k = torch.cat([k[c - n:] for (k, _), n, c in zip(kv, query_lens, ctx)])  # (N_total, Hkv, D)
    new_v = torch.cat([v[c - n:] for (_, v), n, c in zip(kv, query_lens, ctx)])
    cache.k_pool[0].view(-1, n_kv_heads, head_dim)[meta.slot_mapping] = float("nan")  # must be overwritten
    cache.set_metadata(meta)
    positions = torch.cat([torch.arange(c - n, c) for n, c in zip(query_lens, ctx)])[None]
    cache.begin_forward(1, sum(query_lens), positions)  # what the model calls before layer 0
    got = cache.attend(0, q.transpose(0, 1)[None],  # (1, H, N_total, D) as the model passes it
                       new_k.transpose(0, 1)[None], new_v.transpose(0, 1)[None], minillm.attention.sdpa_attention)
    assert got.shape == (1, n_heads, sum(query_lens), head_dim)
    torch.testing.assert_close(got[0].transpose(0, 1), expected, atol=2e-5, rtol=1e-4)


def test_metadata_build_slots_and_checks():
    meta = AttentionMetadata.build([[5, 2], [7]], [6, 3], [2, 3], block_size=4)
    # seq 0 positions 4, 5 -> block 2 offsets 0, 1; seq 1 positions 0..2 -> block 7
    assert meta.slot_mapping.tolist() == [8, 9, 28, 29, 30]
    assert meta.block_tables.tolist() == [[5, 2], [7, -1]] and meta.cu_seqlens_q.tolist() == [0, 2, 5]
    assert not meta.is_decode_only and meta.num_tokens == 5
    with pytest.raises(ValueError, match="need 2 blocks"):
        AttentionMetadata.build([[5]], [6], [1], block_size=4)
    with pytest.raises(ValueError, match="query_len <= context_len"):
        AttentionMetadata.build([[5]], [2], [3], block_size=4)


def test_set_metadata_refuses_unsafe_writes_and_reads():
    cfg = ModelConfig.tiny(n_layers=1)
    cache = PagedKVCache(cfg, num_blocks=6, block_size=4)
    a, b = cache.allocator.allocate(2)
    cache.allocator.incref([b])  # b is shared (a forked prefix): writing into it would corrupt the other owner
    with pytest.raises(ValueError, match="copy-on-write"):
        cache.set_metadata(AttentionMetadata.build([[a, b]], [6], [1], 4))
    cache.set_metadata(AttentionMetadata.build([[b, a]], [5], [1], 4))  # reads b, writes a: fine
    with pytest.raises(ValueError, match="free"):
        cache.set_metadata(AttentionMetadata.build([[a, 5]], [6], [1], 4))  # block 5 was never allocated


def test_engine_mode_needs_metadata_every_forward_and_positions():
    cfg = ModelConfig.tiny()
    model = Transformer(cfg).eval()
    cache = PagedKVCache(cfg, num_blocks=8, block_size=4)
    blocks = cache.allocator.allocate(2)
    cache.set_metadata(AttentionMetadata.build([blocks], [5], [5], 4))
    with pytest.raises(ValueError, match="explicit positions"):
        model(torch.zeros(1, 5, dtype=torch.long), kv_cache=cache)
    model(torch.zeros(1, 5, dtype=torch.long), positions=torch.arange(5)[None], kv_cache=cache)
    with pytest.raises(RuntimeError, match="set_metadata"):  # the metadata was used up by that forward
        model(torch.zeros(1, 1, dtype=torch.long), positions=torch.tensor([[5]]), kv_cache=cache)


def test_self_managed_cache_allocates_on_demand_and_runs_out_cleanly():
    cfg = ModelConfig.tiny()
    model = Transformer(cfg).eval()
    cache = PagedSequenceCache.for_model(model, batch_size=2, max_len=10, block_size=4)
    assert cache.num_blocks == 6 and cache.bytes_used() == 0
    with torch.no_grad():
        model(torch.zeros(2, 5, dtype=torch.long), kv_cache=cache)
        assert [len(t) for t in cache.block_tables_host] == [2, 2] and cache.seq_len == 5
        assert cache.bytes_used() == 4 * cache.bytes_per_block() < cache.nbytes()
        model(torch.zeros(2, 5, dtype=torch.long), kv_cache=cache)
        with pytest.raises(OutOfBlocksError, match="larger max_len"):  # 13 tokens > 3 blocks of 4
            model(torch.zeros(2, 3, dtype=torch.long), kv_cache=cache)
        assert cache.allocator.num_free() == 0 and cache.seq_len == 10  # nothing half-done
    cache.reset()
    assert cache.allocator.num_free() == 6 and cache.seq_len == 0
    with pytest.raises(ValueError, match="context window"):
        PagedSequenceCache.for_model(model, 1, cfg.max_seq_len + 1)


def test_bad_inputs_have_clear_errors():
    q, pool, tables = torch.randn(2, 4, 8), torch.randn(3, 4, 2, 8), torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="pass cache.k_pool"):
        paged_attention(q, pool[None], pool[None], tables, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="must divide"):
        paged_attention(torch.randn(2, 3, 8), pool, pool, tables, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="int"):
        paged_attention(q, pool, pool, tables.float(), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="2 queries need"):
        paged_attention(q, pool, pool, tables[:1], torch.tensor([1]))


@settings(max_examples=10, deadline=None)
@given(prompt_len=st.integers(1, 40), n_new=st.integers(1, 12), block_size=st.sampled_from([1, 4, 16]),
       kv_heads=st.sampled_from([1, 2, 4]), seed=st.integers(0, 1000))
def test_tiny_model_paged_equals_contiguous(prompt_len, n_new, block_size, kv_heads, seed):
    """Logits after a prefill and each decode step, and the greedy tokens, match the contiguous cache; prompt
    lengths and block sizes make steps cross block boundaries."""
    torch.manual_seed(seed)
    model = Transformer(ModelConfig.tiny(n_kv_heads=kv_heads)).eval()
    prompt = torch.randint(0, 512, (1, prompt_len))
    contiguous = KVCache.for_model(model, 1, prompt_len + n_new)
    paged = PagedSequenceCache.for_model(model, 1, prompt_len + n_new, block_size=block_size)
    with torch.no_grad():
        x_c = x_p = prompt
        for _ in range(n_new):
            logits_c, logits_p = model(x_c, kv_cache=contiguous), model(x_p, kv_cache=paged)
            torch.testing.assert_close(logits_p, logits_c, atol=1e-5, rtol=1e-5)
            x_c = logits_c[:, -1:].argmax(-1)
            x_p = logits_p[:, -1:].argmax(-1)
            assert torch.equal(x_c, x_p)
    assert len(paged.block_tables_host[0]) == blocks_needed(prompt_len + n_new - 1, block_size)


def test_generate_paged_identical_on_real_model(real_model):
    model, tok = real_model
    prompt = "Name three primary colors."
    a = minillm.generate(model, tok, prompt, max_new_tokens=32, cache="contiguous", ignore_eos=True)
    b = minillm.generate(model, tok, prompt, max_new_tokens=32, cache="paged", ignore_eos=True)
    assert len(a.token_ids) == 32
    assert b.token_ids == a.token_ids and b.text == a.text
