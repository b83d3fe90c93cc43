"""Prefix caching (minillm/cache/prefix_cache.py, lesson 12): the hash chain, the allocator's three block states and LRU
eviction (a hypothesis state machine against a plain-Python model), and the engine end to end: every output with
prefix caching equals the same request run alone (minillm.generate, no cache sharing), under preemption, aborts,
chunked prefill and speculative decoding; every block comes back."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minillm.cache.block_allocator import BlockAllocator, OutOfBlocksError
from minillm.config import ModelConfig
from minillm.engine import LLM
from minillm.engine.block_manager import BlockManager
from minillm.engine.sequence import Sequence
from minillm.api import generate_ids
from minillm.model import Transformer
from minillm.cache.prefix_cache import ROOT_HASH, PrefixCachingAllocator, block_hashes, hash_block
from minillm.sampling import SamplingParams
from minillm.speculative.decoding import SpeculativeConfig

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------- the hash chain

@given(st.lists(st.integers(0, 49151), max_size=40), st.integers(1, 8), st.integers(0, 39))
def test_hash_chain_names_prefixes(tokens, block_size, split):
    names = block_hashes(tokens, block_size)
    assert len(names) == len(tokens) // block_size  # a partial block has no name
    assert len(set(names)) == len(names)
    # extending a known prefix of the list gives the same names as hashing from scratch
    k = min(split // block_size, len(names))
    assert block_hashes(tokens, block_size, names[:k]) == names
    # the chain: block i's name is its parent's name + its tokens
    parent = ROOT_HASH
    for i, name in enumerate(names):
        assert name == hash_block(parent, tokens[i * block_size:(i + 1) * block_size])
        parent = name
    # one changed token changes its block's name and every name after it, none before
    if names:
        pos = split % (len(names) * block_size)
        changed = list(tokens)
        changed[pos] = (changed[pos] + 1) % 49152
        other = block_hashes(changed, block_size)
        b = pos // block_size
        assert other[:b] == names[:b]
        assert all(x != y for x, y in zip(other[b:], names[b:]))


def test_same_block_at_another_position_is_another_block():
    a = [5, 6, 7, 8]
    assert block_hashes(a + a, 4)[1] != block_hashes(a, 4)[0]  # same tokens, different prefix: not shareable
    assert hash_block(ROOT_HASH, [1, 2]) != hash_block(ROOT_HASH, [2, 1])
    assert hash_block(ROOT_HASH, [1 << 16]) != hash_block(ROOT_HASH, [1])  # ids are not truncated to a byte


# ------------------------------------------------------------------------------------ the allocator, by a model

class PrefixAllocatorMachine(RuleBasedStateMachine):
    """Random allocate / free / register / match+acquire against a plain model of the three states and LRU order."""

    def __init__(self):
        super().__init__()
        self.n = 6
        self.alloc = PrefixCachingAllocator(self.n, 2)
        self.refs = [0] * self.n
        self.names: dict[int, bytes] = {}
        self.lru: list[int] = []  # unowned named blocks, oldest first
        self.owned: list[int] = []  # one entry per reference held

    @rule(k=st.integers(0, 4))
    def allocate(self, k):
        free_unnamed = [b for b in range(self.n) if self.refs[b] == 0 and b not in self.names]
        if k > len(free_unnamed) + len(self.lru):
            with pytest.raises(OutOfBlocksError):
                self.alloc.allocate(k)
            return
        ids = self.alloc.allocate(k)
        n_evict = max(0, k - len(free_unnamed))
        assert set(ids[:k - n_evict]) <= set(free_unnamed), "a cached block was evicted while unnamed ones were free"
        assert ids[k - n_evict:] == self.lru[:n_evict], "eviction is not least recently freed first"
        for b in self.lru[:n_evict]:
            del self.names[b]
        self.lru = self.lru[n_evict:]
        for b in ids:
            self.refs[b] = 1
        self.owned += ids

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def free(self, data):
        blocks = data.draw(st.lists(st.sampled_from(self.owned), min_size=1, max_size=3, unique=True))
        self.alloc.free(blocks)
        for b in blocks:
            self.owned.remove(b)
            self.refs[b] -= 1
            if self.refs[b] == 0 and b in self.names:
                self.lru.append(b)

    @precondition(lambda self: self.owned)
    @rule(data=st.data(), token=st.integers(0, 3))
    def register(self, data, token):
        block = data.draw(st.sampled_from(self.owned))
        name = hash_block(ROOT_HASH, [token])
        fresh = block not in self.names and name not in self.names.values()
        assert self.alloc.register(block, name) == fresh
        if fresh:
            self.names[block] = name

    @rule(tokens=st.lists(st.integers(0, 3), max_size=3))
    def match_and_share(self, tokens):
        hashes = [hash_block(ROOT_HASH, [t]) for t in tokens]
        found = self.alloc.match(hashes)
        by_name = {v: k for k, v in self.names.items()}
        expect = []
        for h in hashes:
            if h not in by_name:
                break
            expect.append(by_name[h])
        assert found == expect
        if found and len(set(found)) == len(found):
            self.alloc.acquire(found)
            for b in found:
                if self.refs[b] == 0:
                    self.lru.remove(b)
                self.refs[b] += 1
            self.owned += found

    @invariant()
    def states_agree(self):
        assert [self.alloc.ref_count(b) for b in range(self.n)] == self.refs
        assert list(self.alloc._evictable) == self.lru
        assert self.alloc.num_free() == sum(r == 0 for r in self.refs)
        assert self.alloc.num_cached() == len(self.names)
        assert not set(self.alloc._free) & set(self.alloc._evictable)
        assert all(self.alloc.is_cached(b) == (b in self.names) for b in range(self.n))


TestPrefixAllocatorMachine = PrefixAllocatorMachine.TestCase
TestPrefixAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=30)


def test_allocator_bad_input():
    alloc = PrefixCachingAllocator(4, 2)
    with pytest.raises(ValueError, match="only blocks found by match"):
        alloc.acquire([0])
    with pytest.raises(ValueError, match="is free"):
        alloc.register(1, b"x" * 32)
    ids = alloc.allocate(2)
    alloc.free(ids)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(ids)
    assert alloc.num_free() == 4


# ---------------------------------------------------------------------------------- the block manager's verbs

def _seq(rid, ids, max_tokens=4):
    return Sequence(rid, list(ids), SamplingParams(max_tokens=max_tokens))


def test_manager_shares_full_blocks_only_and_never_the_last_token():
    bm = BlockManager(PrefixCachingAllocator(16, 4), prefix_caching=True)
    a = _seq("a", range(10))  # blocks [0..3] [4..7] + a partial one
    bm.allocate(a)
    a.num_cached_tokens = 10
    bm.cache_blocks(a)
    assert a.num_named_blocks == 2
    b = _seq("b", list(range(8)) + [99, 98])  # same two full blocks, different tail
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == 8
    c = _seq("c", range(8))  # the whole prompt is cached: its last block is run again (it samples from it)
    bm.allocate(c)
    assert c.num_cached_tokens == 4 and c.block_table[0] == a.block_table[0] and c.block_table[1] != a.block_table[1]
    d = _seq("d", [0, 1, 2, 4] + list(range(4, 10)))  # differs in block 0: nothing is shared
    bm.allocate(d)
    assert d.num_cached_tokens == 0 and not set(d.block_table) & set(a.block_table)
    assert bm.allocator.stats.hit_tokens == 12 and bm.allocator.stats.query_tokens == 38
    for s in (a, b, c, d):
        bm.deallocate(s)
    assert bm.num_free() == 16


def test_manager_truncate_never_cuts_a_cached_block():
    bm = BlockManager(PrefixCachingAllocator(8, 4), prefix_caching=True)
    a = _seq("a", range(9))
    bm.allocate(a)
    a.num_cached_tokens = 9
    bm.cache_blocks(a)
    with pytest.raises(ValueError, match="prefix cache"):
        bm.truncate(a, 5)
    bm.truncate(a, 8)
    assert len(a.block_table) == 2


def test_can_allocate_counts_the_cached_blocks_it_takes():
    """A hit on an unowned cached block uses up one free block: can_allocate must not promise it twice."""
    bm = BlockManager(PrefixCachingAllocator(3, 2), prefix_caching=True)
    a = _seq("a", [1, 2, 3, 4, 5])
    bm.allocate(a)
    a.num_cached_tokens = 5
    bm.deallocate(a)  # two named blocks, unowned
    assert bm.num_free() == 3
    b = _seq("b", [1, 2, 3, 4, 7, 8, 9])  # hits 2 blocks, needs 2 more: 4 > 3
    assert not bm.can_allocate(b)
    c = _seq("c", [1, 2, 3, 4, 7])  # hits 2, needs 1: fits exactly
    assert bm.can_allocate(c)
    bm.allocate(c)
    assert c.num_cached_tokens == 4 and bm.num_free() == 0


# ------------------------------------------------------------------------------------------- the engine, end to end

@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(vocab_size=256, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, n_layers=2, max_seq_len=96)
    return Transformer(cfg).eval()


def shared_prefix_requests(rng, n, vocab, n_prefixes=3):
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(1, 30))] for _ in range(n_prefixes)]
    prompts, params = [], []
    for _ in range(n):
        tail = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        prompts.append(rng.choice(prefixes) + tail or [1])
        params.append(SamplingParams(max_tokens=rng.randint(1, 16), temperature=rng.choice([0.0, 0.0, 0.8]),
                                     seed=rng.randrange(1000), stop_ids={rng.randrange(vocab)}))
    return prompts, params


def solo(model, ids, params):
    return list(generate_ids(model, ids, params, set(params.stop_ids)))


@pytest.mark.parametrize("block_size,num_blocks,max_seqs,budget", [(4, 14, 4, 16), (16, 64, 16, 512), (1, 50, 8, 7),
                                                                   (2, 40, 6, 24)])
def test_outputs_with_prefix_caching_equal_solo_runs(tiny, block_size, num_blocks, max_seqs, budget):
    rng = random.Random(block_size * 7 + num_blocks)
    prompts, params = shared_prefix_requests(rng, 40, tiny.config.vocab_size)
    llm = LLM.from_model(tiny, num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_seqs,
                         max_num_batched_tokens=budget, enable_prefix_caching=True)
    outs = llm.generate(prompts, params)
    for i, (p, sp, out) in enumerate(zip(prompts, params, outs)):
        assert out.token_ids == solo(tiny, p, sp), f"request {i} differs from its solo run"
    assert llm.num_free_blocks() == num_blocks and not llm.has_unfinished()
    stats = llm.prefix_cache_stats
    assert stats.num_requests >= 40
    assert stats.hit_tokens > 0, "shared prefixes were never reused"


def test_prefix_caching_saves_exactly_the_cached_prefill(tiny):
    """Run the same prompt twice, one at a time: the second pass prefills only the uncached tail; a next turn (prompt
    + answer + more) also reuses the answer's blocks, as far as their KV was computed."""
    prompt = list(range(1, 38))  # 37 tokens = 9 full blocks of 4 + 1
    params = SamplingParams(max_tokens=8)
    llm = LLM.from_model(tiny, num_blocks=40, block_size=4, enable_prefix_caching=True)
    first = llm.generate([prompt], params)[0]
    assert sum(s["num_prefill_tokens"] for s in llm.step_log) == 37
    n_steps = len(llm.step_log)
    again = llm.generate([prompt], params)[0]
    assert again.token_ids == first.token_ids
    assert sum(s["num_prefill_tokens"] for s in llm.step_log[n_steps:]) == 1  # 9 blocks came from the cache
    turn = prompt + first.token_ids + [7, 8]  # 47 tokens; KV of 37 + 7 = 44 was computed (the 8th token never ran)
    longer = llm.generate([turn], params)[0]
    assert longer.token_ids == solo(tiny, turn, params)
    assert llm.prefix_cache_stats.hit_tokens == 36 + 44


def test_prefix_caching_under_preemption_aborts_and_speculation(tiny):
    rng = random.Random(5)
    prompts, params = shared_prefix_requests(rng, 60, tiny.config.vocab_size, n_prefixes=2)
    llm = LLM.from_model(tiny, num_blocks=14, block_size=4, max_num_seqs=6, max_num_batched_tokens=20,
                         enable_prefix_caching=True, speculative=SpeculativeConfig(method="ngram", k=3))
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    aborted = set(ids[::7])
    steps = 0
    while llm.has_unfinished():
        llm.step()
        steps += 1
        if steps == 3:
            for r in aborted:
                llm.abort(r)
    assert llm.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    for i, (r, p, sp) in enumerate(zip(ids, prompts, params)):
        out = llm.pop_output(r)
        if r in aborted:
            assert out.finish_reason == "abort"
        else:
            assert out.token_ids == solo(tiny, p, sp), f"request {i} differs from its solo run"
    assert llm.num_free_blocks() == 14


def test_no_prefix_caching_by_default(tiny):
    llm = LLM.from_model(tiny, num_blocks=20, block_size=4)
    assert llm.prefix_cache_stats is None
    llm.generate([[1, 2, 3, 4, 5, 6]] * 2, SamplingParams(max_tokens=2))
    assert sum(s["num_prefill_tokens"] for s in llm.step_log) == 12


def test_real_model_shared_system_prompt(real_model):
    """SmolLM2, chat requests sharing a system prompt: identical greedy answers with and without the cache."""
    model, tok = real_model
    system = "You are a helpful assistant who answers in one short sentence. " * 6
    convs = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
             for q in ("What is the capital of France?", "What is 2 + 2?", "Name a primary colour.")]
    params = SamplingParams(max_tokens=8)
    plain = LLM.from_model(model, tok, num_blocks=64, block_size=16).chat(convs, params)
    cached = LLM.from_model(model, tok, num_blocks=64, block_size=16, enable_prefix_caching=True)
    first = cached.chat(convs[:1], params)
    rest = cached.chat(convs[1:], params)
    assert [o.token_ids for o in first + rest] == [o.token_ids for o in plain]
    assert cached.prefix_cache_stats.hit_tokens >= 64  # the system prompt's full blocks


def test_failed_allocation_gives_the_shared_blocks_back():
    bm = BlockManager(PrefixCachingAllocator(3, 2), prefix_caching=True)
    a = _seq("a", [1, 2, 3, 4, 5])
    bm.allocate(a)
    a.num_cached_tokens = 5
    bm.deallocate(a)
    b = _seq("b", [1, 2, 3, 4, 7, 8, 9])  # needs 2 new blocks beside its 2 hits: only 1 is left
    with pytest.raises(OutOfBlocksError):
        bm.allocate(b)
    assert b.block_table == [] and bm.num_free() == 3 and bm.allocator.num_cached() == 2
    with pytest.raises(ValueError, match="not a block"):
        bm.allocator.register(-1, b"x" * 32)


def test_block_manager_says_whether_it_caches():
    """Prefix caching is a setting, not guessed from the allocator: off by default even on a caching allocator,
    and a plain allocator asked to cache is refused with what it lacks."""
    assert not BlockManager(PrefixCachingAllocator(4, 2)).prefix_caching
    with pytest.raises(TypeError, match="match\\(\\), acquire\\(\\) and register\\(\\)"):
        BlockManager(BlockAllocator(4, 2), prefix_caching=True)
