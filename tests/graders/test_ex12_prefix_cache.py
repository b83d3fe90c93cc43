"""Grader for exercise 12: the chained block hash, the longest cached prefix and LRU eviction of cached blocks.

Everything is compared with oracles written here, not with minillm.cache.prefix_cache. The names: `name_oracle` is
SHA-256 over the parent's name and the ids as little-endian int32, `chain_oracle` chains it over the full blocks;
before the exact bytes, each rule is checked on its own (32 bytes, the parent counts, the order counts, ids are not
truncated, partial blocks have no name, `known` is continued, one changed token renames its block and every later
one), so a wrong answer is named by the rule it breaks. The allocator's two tasks are graded apart: while
match/acquire are graded, allocate/free/num_free are the grader's own (`_grader_allocate` ...), and while
allocate/_evict/free/num_free are graded, match/acquire are; both run on your class and its state (`_free`,
`_evictable`, `_block_of`, `_name_of`, the ref counts). Crafted caches and crafted free/allocate orders say which
block must be found or evicted and why; hypothesis runs random operation sequences against a model of the three
block states (free and unnamed, owned, unowned and named) and of the LRU order; the engine's BlockManager (given
code) shows the sharing a request gets.

The real-model task puts your block_hashes (and through it your hash_block) into minillm.engine.block_manager
and your PrefixCachingAllocator into minillm.engine.llm (the engine builds its allocator there), and serves
SmolLM2-135M chat requests that share a system prompt on a 10-block pool, one phase after another (c0; c1 and
c2 at once; b0 with another system prompt, which must evict; c0 again). Each answer must be the greedy answer
of the engine without prefix caching, each phase must hit as many prompt tokens and evict as many blocks as
minillm's own prefix cache, and every block must be back at the end.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import random
import struct
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minillm
from minillm.cache.block_allocator import OutOfBlocksError
from minillm.sampling import SamplingParams
from tests.graders.conftest import ROOT, TARGET, forbid_calls, load_impl
from tests.graders.real_model import one_thread, same_tokens

impl = load_impl("ex12_prefix_cache")
LIBRARY = ["minillm", "prefix_cache"]
ROOT_NAME = bytes(32)  # the parent of a sequence's first block
MAX_ID = 2**31 - 1  # the largest id an int32 holds
token_ids = st.one_of(st.integers(0, 49151), st.integers(0, MAX_ID))  # SmolLM2's vocabulary, and any int32


def _pack(tokens, fmt: str = "<i") -> bytes:
    return b"".join(struct.pack(fmt, t) for t in tokens)


# ================================================================================================= task 12.hash


def name_oracle(parent: bytes, tokens) -> bytes:
    """SHA-256 of the parent's 32-byte name, then each token id as 4 little-endian bytes (int32)."""
    return hashlib.sha256(bytes(parent) + _pack(tokens)).digest()


def chain_oracle(tokens, block_size: int) -> list[bytes]:
    """One name per full block, each hashed with the name before it (ROOT_NAME before the first)."""
    names, parent = [], ROOT_NAME
    for start in range(0, len(tokens) // block_size * block_size, block_size):
        parent = name_oracle(parent, tokens[start:start + block_size])
        names.append(parent)
    return names


def _short(name) -> str:
    if isinstance(name, (bytes, bytearray)):
        return "ROOT_HASH" if name == ROOT_NAME else f"<{bytes(name[:4]).hex()}...>"
    return repr(name)


def call_hash(parent: bytes, tokens) -> bytes:
    """Your hash_block, with its return type checked."""
    got = impl.hash_block(parent, tokens)
    what = f"hash_block({_short(parent)}, {list(tokens)!r})"
    assert isinstance(got, bytes), (
        f"{what} returned {type(got).__name__} {got!r:.60}: a block's name is the 32-byte SHA-256 digest, "
        f"hashlib.sha256(...).digest() (Python's hash() gives an int that changes from one process to the next for "
        f"str and bytes, and is easy to make collide: one user would be served another user's keys and values)")
    assert len(got) == 32, f"{what} returned {len(got)} bytes; a SHA-256 digest has 32 (.digest(), not .hexdigest())"
    return got


def hash_diagnosis(parent: bytes, tokens) -> str:
    """What your name equals, when it equals a well-known wrong encoding."""
    t = list(tokens)
    candidates = [
        (hashlib.sha256(_pack(t)).digest(),
         "SHA-256 of the tokens alone: the parent's name is left out, so it no longer says what came before"),
        (hashlib.sha256(parent + bytes(x & 0xFF for x in t)).digest(),
         "one byte per token id: ids >= 256 are truncated (SmolLM2 has 49,152 ids)"),
        (hashlib.sha256(parent + _pack(t, "<q")).digest(),
         "8 bytes per id (int64); the documented encoding is 4 (int32: array('i', tokens).tobytes())"),
        (hashlib.sha256(parent + _pack(t, ">i")).digest(),
         "big-endian ids; the documented encoding is little-endian (array('i', ...) on x86 and ARM)"),
        (hashlib.sha256(_pack(t) + parent).digest(), "the tokens hashed before the parent: the parent comes first"),
        (hashlib.sha256(parent + str(t).encode()).digest(), "the ids as text; hash them as int32 (4 bytes each)"),
        (hashlib.sha256(parent + str(tuple(t)).encode()).digest(), "the ids as text; hash them as int32"),
    ]
    got = impl.hash_block(parent, tokens)
    for value, why in candidates:
        if got == value:
            return f" = {why}"
    return ""


def same_in_another_process(parent: bytes, tokens: list[int], got: bytes) -> bool:
    """Does a fresh Python process (another PYTHONHASHSEED) give your hash_block the same name?"""
    code = ("import importlib, sys; m = importlib.import_module(sys.argv[1]); "
            "print(m.hash_block(bytes.fromhex(sys.argv[2]), [int(x) for x in sys.argv[3].split(',')]).hex())")
    env = {**os.environ, "PYTHONHASHSEED": "random", "MINILLM_GRADE": TARGET}
    proc = subprocess.run([sys.executable, "-c", code, impl.__name__, parent.hex(), ",".join(map(str, tokens))],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    return proc.returncode == 0 and proc.stdout.strip() == got.hex()


@pytest.mark.task_12_hash
def test_hash_block_rules():
    forbid_calls(impl.hash_block, LIBRARY)
    block = [17, 4242, 3, 49151]
    a = call_hash(ROOT_NAME, block)
    assert call_hash(ROOT_NAME, list(block)) == a, "hash_block gave two names for the same parent and tokens"
    assert call_hash(ROOT_NAME, tuple(block)) == a, (
        "hash_block(ROOT_HASH, a tuple) differs from hash_block(ROOT_HASH, the same ids in a list): the name depends "
        "on the ids, not on the container (the engine passes list slices; hash the int32 bytes, not repr())")
    other_parent = name_oracle(ROOT_NAME, [1, 2, 3, 4])
    assert call_hash(other_parent, block) != a, (
        f"hash_block(parent, {block}) is the same for two different parents: the name must include the parent's name, "
        f"else the same block after other tokens gets the same name and a request reads keys and values computed "
        f"after someone else's prefix (RoPE and attention make a block's KV depend on every token before it)")
    assert call_hash(ROOT_NAME, [1, 2]) != call_hash(ROOT_NAME, [2, 1]), "the order of the ids must change the name"
    widths = [[1], [257], [65537], [(1 << 24) + 1], [(1 << 31) - 1], [0], [256]]
    names = [call_hash(ROOT_NAME, w) for w in widths]
    for i in range(len(widths)):
        for j in range(i):
            assert names[i] != names[j], (
                f"hash_block(ROOT_HASH, {widths[i]}) == hash_block(ROOT_HASH, {widths[j]}): token ids are truncated; "
                f"hash each id as 4 bytes (int32), e.g. array('i', tokens).tobytes()")
    kept = list(block)
    call_hash(ROOT_NAME, kept)
    assert kept == block, f"hash_block changed its tokens argument ({block} -> {kept})"
    # the documented bytes: SHA-256(parent + int32 little-endian ids); the same in any process, on any replica
    for parent, tokens in [(ROOT_NAME, block), (other_parent, [0, 1, 2, 3, 4, 5, 6, 7]), (a, [MAX_ID]),
                           (ROOT_NAME, list(range(300, 316)))]:
        got = call_hash(parent, tokens)
        if got == name_oracle(parent, tokens):
            continue
        diagnosis = hash_diagnosis(parent, tokens)
        if not diagnosis and not same_in_another_process(parent, tokens, got):
            diagnosis = (" and a fresh Python process gives another name for the same block: names must be the "
                         "same in every process (Python's hash() of str and bytes is salted per process)")
        raise AssertionError(
            f"hash_block({_short(parent)}, {tokens}) is not SHA-256(parent + the ids as little-endian int32){diagnosis}"
            f" (got {got.hex()[:16]}..., expected {name_oracle(parent, tokens).hex()[:16]}...): every process, and "
            f"every replica sharing a KV store, must give a prefix the same name")


def call_chain(tokens, block_size: int, known=()) -> list[bytes]:
    got = impl.block_hashes(tokens, block_size, known) if known != () else impl.block_hashes(tokens, block_size)
    what = f"block_hashes({len(tokens)} tokens, block_size={block_size}, {len(known)} known)"
    assert isinstance(got, list), f"{what} returned {type(got).__name__}, expected a list of names"
    assert all(isinstance(n, bytes) for n in got), f"{what} holds something other than bytes: {got!r:.120}"
    return got


@pytest.mark.task_12_hash
def test_block_hashes_crafted():
    forbid_calls(impl.block_hashes, LIBRARY)
    tokens = list(range(100, 110))  # blocks [100..103] [104..107] and a partial [108, 109]
    got = call_chain(tokens, 4)
    if len(got) == 3:
        raise AssertionError(
            "block_hashes(10 tokens, block_size=4) named the partial last block [108, 109]: a block gets a name only "
            "once all its block_size tokens are there; a partly filled block is still being written (a request "
            "sharing it would read slots its owner has not filled, and its owner would write into a shared block)")
    assert len(got) == 2, f"block_hashes(10 tokens, block_size=4) returned {len(got)} names; 2 full blocks, 2 names"
    assert got[0] == call_hash(ROOT_NAME, tokens[:4]), (
        "block 0's name must be hash_block(ROOT_HASH, tokens[0:4]): ROOT_HASH (bytes(32)) is the first block's parent")
    if got[1] == call_hash(ROOT_NAME, tokens[4:8]) and got[1] != call_hash(got[0], tokens[4:8]):
        raise AssertionError("block 1's name is hash_block(ROOT_HASH, its tokens): chain it, hash_block(name of block "
                             "0, tokens[4:8]), so that equal names mean equal prefixes")
    assert got[1] == call_hash(got[0], tokens[4:8]), "block 1's name must be hash_block(name of block 0, tokens[4:8])"
    for n in range(13):
        assert len(call_chain(list(range(n)), 4)) == n // 4, (
            f"{n} tokens in blocks of 4 have {n // 4} full blocks, so {n // 4} names (a partial block has none)")
    assert call_chain([5, 6, 7], 1) == chain_oracle([5, 6, 7], 1), "block_size=1: one name per token, chained"
    assert call_chain([], 4) == [], "no tokens, no names"
    a = [5, 6, 7, 8]
    twice = call_chain(a + a, 4)
    assert twice[1] != twice[0], (
        "the blocks [5, 6, 7, 8] + [5, 6, 7, 8] got the same name twice: block 1 has the same tokens as block 0 but "
        "another prefix, so other keys and values (positions and context differ); its name must differ")
    assert twice == chain_oracle(a + a, 4), "the names differ from SHA-256's chain (see test_hash_block_rules)"


@pytest.mark.task_12_hash
def test_block_hashes_continue_what_is_known():
    tokens = list(range(200, 213))  # three full blocks of 4 and one token
    fake = [bytes([1]) * 32, bytes([2]) * 32]  # names the grader pretends were computed earlier
    got = call_chain(tokens, 4, fake)
    assert len(got) == 3, f"13 tokens in blocks of 4, 2 names known: expected 3 names, got {len(got)}"
    if got[:2] != fake:
        raise AssertionError(
            "block_hashes(tokens, 4, known) did not keep `known` as its first names (it recomputed them): the engine "
            "passes the names a growing sequence already has, so that a decode step hashes only its new full block, "
            "not its whole prompt again")
    want = call_hash(fake[1], tokens[8:12])
    if got[2] != want:
        if got[2] == call_hash(ROOT_NAME, tokens[8:12]):
            raise AssertionError("block 2's name was hashed from ROOT_HASH: after the known names, the chain "
                                 "continues from the last known one, hash_block(known[-1], tokens[8:12])")
        raise AssertionError("block 2's name must be hash_block(known[-1], tokens[8:12]): the chain continues from "
                             "the last known name")
    assert call_chain(tokens, 4, tuple(fake)) == got, "known may be any sequence of names (a tuple: the default is ())"
    names = call_chain(tokens, 4)
    assert call_chain(tokens, 4, names) == names, "when every full block's name is known, block_hashes returns them"
    assert call_chain(tokens[:9], 4, names[:1]) == names[:2], (
        "9 tokens with block 0's name known: the names of blocks 0 and 1, as from scratch")


@pytest.mark.task_12_hash
@settings(max_examples=120, deadline=None)
@given(st.lists(token_ids, max_size=40), st.integers(1, 8), st.integers(0, 10**6), st.integers(0, 10**6))
def test_block_hashes_random(tokens, block_size, split, pos):
    got = call_chain(tokens, block_size)
    want = chain_oracle(tokens, block_size)
    assert len(got) == len(want), (f"{len(tokens)} tokens in blocks of {block_size}: {len(want)} full blocks, "
                                   f"so {len(want)} names; got {len(got)}")
    assert got == want, (f"{len(tokens)} tokens in blocks of {block_size}: block "
                         f"{next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)} has another name than "
                         f"SHA-256's chain")
    k = split % (len(got) + 1)
    assert call_chain(tokens, block_size, got[:k]) == got, (
        f"with the first {k} names known, block_hashes must give the same names as from scratch")
    if got:
        p = pos % (len(got) * block_size)
        changed = list(tokens)
        changed[p] = (changed[p] + 1) % (MAX_ID + 1)
        other = call_chain(changed, block_size)
        b = p // block_size
        assert other[:b] == got[:b], (
            f"changing token {p} (block {b}) changed the name of an earlier block: a name depends only on the "
            f"tokens up to the end of its block")
        same = [j for j in range(b, len(got)) if other[j] == got[j]]
        assert not same, (
            f"changing token {p} (block {b}) left block {same[0]}'s name as it was: one differing token must change "
            f"its block's name and every name after it (the chain: each name hashes the one before it)")


# ======================================================================= the grader's own allocator methods
# Graded apart: your match/acquire run on top of these allocate/free/num_free, and your allocate/_evict/free/num_free
# under these match/acquire. They work on your class's state, as documented in the exercise.


def _grader_num_free(self) -> int:
    return len(self._free) + len(self._evictable)


def _grader_allocate(self, n: int = 1) -> list[int]:
    if n < 0:
        raise ValueError(f"negative n ({n})")
    if n > len(self._free) + len(self._evictable):
        raise OutOfBlocksError(f"the grader's allocate: {n} blocks asked, {_grader_num_free(self)} free")
    out = []
    for _ in range(n):
        if self._free:
            block = self._free.popleft()
        else:  # the least recently freed cached block, its name forgotten
            block = next(iter(self._evictable))
            del self._evictable[block]
            del self._block_of[self._name_of.pop(block)]
            self.stats.evictions += 1
        self._ref_counts[block] = 1
        out.append(block)
    return out


def _grader_free(self, block_ids) -> None:
    block_ids = list(block_ids)
    for block, times in Counter(block_ids).items():
        if not (isinstance(block, int) and 0 <= block < self.num_blocks) or times > self._ref_counts[block]:
            raise ValueError(f"the grader's free: block {block} is not owned {times} time(s)")
    for block in block_ids:
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            if block in self._name_of:
                self._evictable[block] = None  # most recently freed last
            else:
                self._free.append(block)


def _grader_match(self, hashes) -> list[int]:
    out = []
    for name in hashes:
        if name not in self._block_of:
            break
        out.append(self._block_of[name])
    return out


def _grader_acquire(self, block_ids) -> None:
    for block in block_ids:
        if block not in self._name_of:
            raise ValueError(f"the grader's acquire: block {block} has no name")
    for block in block_ids:
        self._evictable.pop(block, None)
        self._ref_counts[block] += 1


def yours_with(**grader_methods) -> type:
    return type("YourAllocator", (impl.PrefixCachingAllocator,), grader_methods)


def match_under_test() -> type:
    """Your match and acquire; the grader's allocate, free and num_free."""
    return yours_with(allocate=_grader_allocate, free=_grader_free, num_free=_grader_num_free)


def lru_under_test() -> type:
    """Your num_free, allocate, _evict and free; the grader's match and acquire."""
    return yours_with(match=_grader_match, acquire=_grader_acquire)


def state(a) -> tuple:
    return ([a.ref_count(b) for b in range(a.num_blocks)], sorted(a._free), list(a._evictable), dict(a._block_of),
            dict(a._name_of), a.stats.evictions)


def check_class(methods: list[str]) -> None:
    cls = impl.PrefixCachingAllocator
    assert importlib.import_module("minillm.cache.prefix_cache").PrefixCachingAllocator not in cls.__mro__, (
        "your PrefixCachingAllocator subclasses minillm's: write the methods yourself")
    for m in methods:
        assert m in vars(cls), f"PrefixCachingAllocator.{m} must be written in your class"
    forbid_calls(cls, LIBRARY)


# ================================================================================================ task 12.match

NAMES = chain_oracle(list(range(24)), 4)  # six chained names, n0 .. n5
UNKNOWN = name_oracle(ROOT_NAME, [999])


def _label(name: bytes) -> str:
    return f"n{NAMES.index(name)}" if name in NAMES else "unknown"


def check_match(a, query: list[bytes], want: list[int], why: str) -> list[int]:
    before = state(a)
    got = a.match(query)
    what = f"match([{', '.join(map(_label, query))}])"
    assert isinstance(got, list) and all(type(b) is int for b in got), (
        f"{what} returned {got!r}: expected a list of block ids")
    assert got == want, f"{what} returned blocks {got}, expected {want}: {why}"
    assert state(a) == before, (
        f"{what} changed the allocator (ref counts, free list, LRU order or names): match only looks the names up; "
        f"acquire is what takes the blocks, and the BlockManager may not take them at all")
    return got


@pytest.mark.task_12_match
def test_match_crafted():
    check_class(["match", "acquire"])
    a = match_under_test()(8, 4)
    blocks = a.allocate(4)
    for b, name in zip(blocks, NAMES):
        assert a.register(b, name)
    n = NAMES
    check_match(a, n[:4], blocks, "all four names are cached")
    check_match(a, n[:5], blocks, "n4 is not cached: the cached prefix ends before it")
    check_match(a, [], [], "no names, no blocks")
    check_match(a, n[:1], blocks[:1], "n0 is cached")
    check_match(a, [UNKNOWN] + n[:4], [], "the first name is not cached: nothing is, as a prefix, however many later "
                                          "names are")
    check_match(a, n[:2] + [UNKNOWN] + n[3:4], blocks[:2],
                "stop at the first name that is not cached: a block after it holds keys and values computed after "
                "tokens this request does not have, and the request must compute the missing block itself")
    a.free(blocks[::-1])  # every owner gone: the blocks keep their names and their KV, in the LRU list
    check_match(a, n[:4], blocks, "blocks whose owners are all gone are still cached (free kept their KV)")
    # a chain whose head was evicted: the grader's allocate takes the never-used block, then the oldest cached one
    a2 = match_under_test()(4, 2)
    chain = a2.allocate(3)
    for b, name in zip(chain, NAMES):
        a2.register(b, name)
    a2.free([chain[0]])  # freed head first, then the rest: the head is evicted first
    a2.free(chain[1:])
    a2.allocate(2)  # the never-used block, then the head
    assert chain[0] not in a2._name_of, "grader self-check"
    check_match(a2, n[:3], [], "the chain's head n0 was evicted: n1 and n2 are still cached, but their keys and "
                               "values were computed after n0's tokens, which the request would now lack")


@pytest.mark.task_12_match
def test_acquire_shares_blocks():
    a = match_under_test()(8, 4)
    blocks = a.allocate(4)
    for b, name in zip(blocks, NAMES):
        a.register(b, name)
    a.free(blocks[::-1])
    assert a.num_free() == 8
    found = check_match(a, NAMES[:3], blocks[:3], "n0..n2 are cached")
    a.acquire(found)
    for b in found:
        assert a.ref_count(b) == 1, f"acquire: block {b} had no owner, now one; its ref count is {a.ref_count(b)}"
        assert b not in a._evictable, (
            f"acquire: block {b} is owned again but still in the LRU list (_evictable): allocate could evict it while "
            f"a request reads it; an acquired block leaves the LRU list")
    assert a.num_free() == 5, f"3 of 8 blocks acquired: 5 free, num_free() says {a.num_free()}"
    assert list(a._evictable) == [blocks[3]], "acquire must leave the other cached blocks in the LRU list, in order"
    a.acquire(found[:1])
    assert a.ref_count(found[0]) == 2, "acquire of an owned cached block adds an owner: ref count 2"
    a.free(found[:1])
    assert a.ref_count(found[0]) == 1 and found[0] not in a._evictable, "one owner left: still owned"
    taken = a.allocate(5)
    assert not set(taken) & set(found), f"allocate handed out an acquired block ({sorted(set(taken) & set(found))})"
    # only a named block can be shared
    b = match_under_test()(4, 2)
    x = b.allocate(2)
    b.register(x[0], NAMES[0])
    before = state(b)
    for bad, why in [([x[0], x[1]], f"block {x[1]} has no name"), ([2], "block 2 is free and has no name")]:
        try:
            b.acquire(bad)
        except ValueError:
            pass
        else:
            raise AssertionError(f"acquire({bad}): {why}: only blocks found by match can be shared (ValueError)")
        assert state(b) == before, f"a refused acquire({bad}) changed the allocator: check every block first"


@pytest.mark.task_12_match
@settings(max_examples=80, deadline=None)
@given(st.data())
def test_match_random(data):
    pool = [name_oracle(ROOT_NAME, [i]) for i in range(10)]
    a = match_under_test()(12, 1)
    held = a.allocate(data.draw(st.integers(0, 10)))
    cached = {}
    for b, i in zip(held, data.draw(st.permutations(range(10)))):
        a.register(b, pool[i])
        cached[pool[i]] = b
    a.free(data.draw(st.lists(st.sampled_from(held), unique=True)) if held else [])
    query = [pool[i] for i in data.draw(st.lists(st.integers(0, 9), max_size=8))]
    want = []
    for name in query:
        if name not in cached:
            break
        want.append(cached[name])
    before = state(a)
    got = a.match(query)
    labels = [f"n{pool.index(q)}{'' if q in cached else ' (not cached)'}" for q in query]
    assert got == want, f"match([{', '.join(labels)}]) returned {got}, expected {want}: the blocks up to the first miss"
    assert state(a) == before, "match changed the allocator: it only looks"


def _seq(rid: str, ids):
    from minillm.engine.sequence import Sequence
    from minillm.sampling import SamplingParams

    return Sequence(rid, list(ids), SamplingParams(max_tokens=4))


@pytest.mark.task_12_match
def test_identical_prefixes_share_blocks_in_the_block_manager():
    """Through the engine's BlockManager (given): its allocate looks the prompt's names up with your match (never the
    last token: that one is always run) and shares the blocks with your acquire."""
    from minillm.engine.block_manager import BlockManager

    bm = BlockManager(match_under_test()(24, 4), prefix_caching=True)
    a = _seq("a", range(10))  # blocks [0..3] [4..7] and a partial [8, 9]
    bm.allocate(a)
    a.num_cached_tokens = 10  # a's prefill ran: its two full blocks get names
    bm.cache_blocks(a)
    others = []

    def admit(rid, ids, n_shared, why):
        s = _seq(rid, ids)
        bm.allocate(s)
        others.append(s)
        assert s.block_table[:n_shared] == a.block_table[:n_shared] and s.num_cached_tokens == 4 * n_shared, (
            f"request {rid} {why}: it must share a's first {n_shared} block(s) ({a.block_table[:n_shared]}) and skip "
            f"{4 * n_shared} prompt tokens; it got blocks {s.block_table} with {s.num_cached_tokens} cached tokens")
        assert not set(s.block_table[n_shared:]) & set(a.block_table), (
            f"request {rid} {why}: after its first {n_shared} block(s) it must have blocks of its own, got "
            f"{s.block_table} (a holds {a.block_table})")
        return s

    admit("b", list(range(8)) + [99, 98, 97], 2, "starts with a's 8 tokens (two full blocks)")
    admit("c", [0, 1, 2, 3, 4, 77, 6, 7, 8, 9], 1, "differs from a at token 5: block 1 and everything after it differ")
    admit("d", [77] + list(range(1, 10)), 0, "differs from a at token 0: no block is shared")
    admit("e", list(range(13)), 2, "has a's 10 tokens and 3 more: a's third block holds only 2 tokens, it has no name "
                                   "and is never shared")
    admit("f", [50, 1, 2, 3] + list(range(4, 10)), 0,
          "differs at token 0 only: its block 1 has a's tokens, but after another block 0, so another name")
    admit("h", range(8), 1, "is exactly a's two full blocks: the BlockManager always runs a prompt's last token (its "
                            "logits give the first output token), so only block 0 comes from the cache")
    assert bm.allocator.ref_count(a.block_table[0]) == 5, (
        f"a's block 0 is held by a, b, c, e and h: ref count 5, got {bm.allocator.ref_count(a.block_table[0])}")
    a_blocks = list(a.block_table)
    for s in [a, *others]:
        bm.deallocate(s)
    assert bm.num_free() == 24 and all(bm.allocator.ref_count(b) == 0 for b in range(24)), "every block is back"
    g = _seq("g", range(10))  # a's prompt again, after everyone left: its blocks are still cached
    bm.allocate(g)
    assert g.block_table[:2] == a_blocks[:2] and g.num_cached_tokens == 8, (
        f"request g repeats a's prompt after a finished: a's two named blocks are cached (nobody owns them), so g must "
        f"get them back ({a_blocks[:2]}); it got {g.block_table} with {g.num_cached_tokens} cached tokens")
    assert bm.num_free() == 24 - 3, "g holds 3 blocks (two taken back from the cache, one new)"


# ================================================================================================== task 12.lru


def must_be_out_of_blocks(a, n: int, why: str) -> None:
    before = state(a)
    try:
        got = a.allocate(n)
    except OutOfBlocksError:
        pass
    except Exception as e:
        raise AssertionError(f"allocate({n}) {why}: expected OutOfBlocksError, raised {type(e).__name__}: {e}") from e
    else:
        raise AssertionError(f"allocate({n}) {why}: expected OutOfBlocksError, got blocks {got}")
    assert state(a) == before, f"a failed allocate({n}) changed the allocator: all or nothing, check before taking"


def must_refuse_free(a, blocks: list[int], why: str) -> None:
    before = state(a)
    try:
        a.free(blocks)
    except ValueError:
        pass
    except NotImplementedError:
        raise
    except Exception as e:
        raise AssertionError(f"free({blocks}) {why}: expected ValueError, raised {type(e).__name__}: {e}") from e
    else:
        raise AssertionError(f"free({blocks}) {why}: expected ValueError (a double free)")
    assert state(a) == before, (
        f"the refused free({blocks}) changed the allocator: check every block before changing anything "
        f"(BlockAllocator.free, via super(), does)")


def is_cached_state(a, block: int, name: bytes, what: str) -> None:
    assert a.ref_count(block) == 0, f"{what}: block {block} should have no owner"
    assert a._block_of.get(name) == block and a._name_of.get(block) == name, (
        f"{what}: block {block} lost its name; a named block keeps it when its last owner frees it, so the next "
        f"request with that prefix finds its keys and values")
    assert block in a._evictable and block not in a._free, (
        f"{what}: a freed named block goes into the LRU list (_evictable), not onto the free list (_free): "
        f"_free is for blocks with nothing worth keeping, handed out first")


@pytest.mark.task_12_lru
def test_lru_crafted_story():
    check_class(["num_free", "allocate", "_evict", "free"])
    a = lru_under_test()(6, 2)
    assert a.num_free() == 6, f"a new pool of 6: num_free() is {a.num_free()}"
    x = a.allocate(3)
    assert len(set(x)) == 3 and all(a.ref_count(b) == 1 for b in x), f"allocate(3) gave {x}: 3 blocks, ref count 1"
    assert a.num_free() == 3
    a.register(x[0], NAMES[0])
    a.register(x[1], NAMES[1])  # x[2] is a partial block: no name
    a.free(x[::-1])  # tail first, as the BlockManager frees: x2 (unnamed), then x1, then x0
    is_cached_state(a, x[0], NAMES[0], "after free")
    is_cached_state(a, x[1], NAMES[1], "after free")
    assert x[2] in a._free and x[2] not in a._evictable, "an unnamed block whose owner freed it goes back on _free"
    assert a.num_free() == 6, (
        f"num_free() is {a.num_free()} with no block owned: cached blocks count as free (the pool can hand them out "
        f"at any time; without them can_allocate refuses requests the pool could serve)")
    assert _grader_match(a, NAMES[:2]) == x[:2], "both cached names must still be found"
    y = a.allocate(4)
    assert not set(y) & set(x[:2]), (
        f"allocate(4) with 4 unnamed free blocks evicted cached block(s) {sorted(set(y) & set(x[:2]))}: hand out "
        f"never-named free blocks first, evict only when none is left")
    assert a.stats.evictions == 0
    z = a.allocate(1)
    if z == [x[0]]:
        raise AssertionError(
            f"allocate(1) evicted block {x[0]} (n0) instead of {x[1]} (n1): free({x[::-1]}) (tail first, as the "
            f"BlockManager frees a sequence) freed n1's block before n0's, in the order of its ids, so n1's is the "
            f"least recently freed and goes first. Evict the LRU list's oldest block, and append a call's blocks in "
            f"the order given: a chain then loses its tail first and its head, which every request with that prefix "
            f"needs, last")
    assert z == [x[1]], f"allocate(1) must evict the least recently freed cached block {x[1]}, got {z}"
    assert a.ref_count(x[1]) == 1, "an evicted block is handed out with ref count 1"
    assert NAMES[1] not in a._block_of and x[1] not in a._name_of and not a.is_cached(x[1]), (
        f"block {x[1]} was evicted but its name n1 is still known: a later match(n0, n1) would hand out block "
        f"{x[1]}, whose keys and values now belong to another sequence; forget the name in both directions")
    assert _grader_match(a, NAMES[:2]) == [x[0]], "after n1's eviction only n0 is cached"
    assert a.stats.evictions == 1, f"stats.evictions counts the evictions: 1, got {a.stats.evictions}"
    assert a.num_free() == 1 and list(a._evictable) == [x[0]]
    must_be_out_of_blocks(a, 2, "with one free (cached) block")
    assert a.allocate(1) == [x[0]] and not a._block_of and a.stats.evictions == 2, (
        "the last cached block is evicted and its name forgotten")
    must_be_out_of_blocks(a, 1, "with no free block")
    assert a.allocate(0) == [], "allocate(0) gives []"
    try:
        a.allocate(-1)
        raise AssertionError("allocate(-1) must raise ValueError")
    except ValueError:
        pass


@pytest.mark.task_12_lru
def test_lru_order_follows_the_frees():
    a = lru_under_test()(5, 2)
    b = a.allocate(5)
    for block, name in zip(b, NAMES):
        a.register(block, name)
    a.free([b[2]])
    a.free([b[3], b[0], b[4]])  # one call: the order of its ids is the order they were freed in
    _grader_acquire(a, [b[4]])  # a request takes n4's block back, then frees it: it is now the most recently freed
    a.free([b[4]])
    a.free([b[1]])
    want = [b[2], b[3], b[0], b[4], b[1]]
    got = [a.allocate(1)[0] for _ in range(5)]
    if got != want:
        if got == want[::-1]:
            hint = "most recently freed first: evict the least recently freed"
        elif got == [b[2], b[0], b[3], b[4], b[1]]:
            hint = ("free([b3, b0, b4]) put b0 before b3 in the LRU list: the blocks of one call are freed in the "
                    "order of its ids (the BlockManager passes a sequence's blocks tail first)")
        else:
            hint = ("the frees were: [b2], then [b3, b0, b4] in one call, then b4 was acquired and freed again, "
                    "then [b1]")
        raise AssertionError(f"5 evictions, one at a time, gave blocks {got}; least recently freed first is {want}: "
                             f"{hint}")
    assert not a._block_of and not a._name_of and not a._evictable, "every evicted block forgot its name"


@pytest.mark.task_12_lru
def test_all_or_nothing_and_double_free():
    a = lru_under_test()(5, 2)
    x = a.allocate(5)
    a.register(x[0], NAMES[0])
    a.register(x[1], NAMES[1])
    a.free([x[1], x[0]])
    assert a.num_free() == 2 and a.can_allocate(2) and not a.can_allocate(3), (
        f"two cached unowned blocks: num_free() must be 2, got {a.num_free()}")
    must_be_out_of_blocks(a, 3, "with 2 free (cached) blocks")
    must_refuse_free(a, [x[0]], f"of block {x[0]}, already free (cached)")
    must_refuse_free(a, [x[2], x[2]], f"of block {x[2]} twice, which has one owner")
    must_refuse_free(a, [x[3], x[4], x[1]], f"of blocks {x[3]} and {x[4]} (owned) and {x[1]} (already free)")
    a.free([x[3], x[4]])
    must_refuse_free(a, [x[2], x[3]], f"of block {x[2]} (owned) and {x[3]} (already free)")
    _grader_acquire(a, [x[0]])
    _grader_acquire(a, [x[0]])
    a.free([x[0], x[0]])  # two owners, two frees: fine
    assert a.ref_count(x[0]) == 0 and list(a._evictable) == [x[1], x[0]], "x0 was freed by both its owners"
    got = a.allocate(4)
    assert set(got) == {x[3], x[4], x[1], x[0]} and a._block_of == {}, (
        f"allocate(4) with 2 unnamed and 2 cached free blocks takes all four (evicting both), got {got}")


@pytest.mark.task_12_lru
def test_the_block_managers_tail_first_frees():
    """The engine's BlockManager (given) frees a finished sequence's blocks tail first: a chain is evicted from its
    tail, and a request with the same prefix still finds the head."""
    from minillm.engine.block_manager import BlockManager

    bm = BlockManager(lru_under_test()(6, 4), prefix_caching=True)
    a = _seq("a", range(14))  # 3 full blocks + 2 tokens
    bm.allocate(a)
    a.num_cached_tokens = 14
    blocks = list(a.block_table)
    bm.deallocate(a)  # names blocks 0..2, frees [3, 2, 1, 0]
    assert bm.num_free() == 6, f"a finished: all 6 blocks free (3 of them cached), num_free() says {bm.num_free()}"
    b = _seq("b", [90 + i for i in range(14)])  # another prompt: 4 blocks, 3 unnamed free + 1 eviction
    bm.allocate(b)
    assert blocks[2] in b.block_table and not set(blocks[:2]) & set(b.block_table), (
        f"b needs 4 blocks with 3 unnamed ones free: the one to evict is a's tail block {blocks[2]} (freed first), "
        f"got {b.block_table} (a had {blocks})")
    assert bm.num_free() == 2, f"b holds 4 of 6 blocks: num_free() must be 2 (a's cached head), got {bm.num_free()}"
    bm.deallocate(b)  # b's prefill never ran: nothing of it is named
    c = _seq("c", range(10))  # a's first 8 tokens + 2: a's blocks 0 and 1 are still cached
    bm.allocate(c)
    assert c.block_table[:2] == blocks[:2] and c.num_cached_tokens == 8, (
        f"c starts like a: a's head blocks {blocks[:2]} must still be cached, got {c.block_table}")
    assert bm.num_free() == 3
    bm.deallocate(c)
    assert bm.num_free() == 6 and all(bm.allocator.ref_count(i) == 0 for i in range(6)), "every block is back"


@pytest.mark.task_12_lru
@settings(max_examples=120, deadline=None)
@given(st.integers(2, 7), st.lists(st.tuples(st.sampled_from("aaffrsd"), st.integers(0, 2**20)), max_size=40))
def test_lru_random_against_a_model(n, ops):
    """Random allocate / free / register / share / double free, against a model: refs, names and the LRU list."""
    a = lru_under_test()(n, 2)
    refs, names, lru, owned, log = [0] * n, {}, [], [], []
    pool = [name_oracle(ROOT_NAME, [i]) for i in range(6)]

    def fail(msg: str) -> None:
        raise AssertionError(f"{msg}\n  after: {'; '.join(log[-8:])}")

    for op, r in ops:
        rng = random.Random(r)
        if op == "a":
            k = rng.randint(0, 3)
            unnamed = [b for b in range(n) if refs[b] == 0 and b not in names]
            if k > len(unnamed) + len(lru):
                log.append(f"allocate({k}) -> out of blocks")
                must_be_out_of_blocks(a, k, f"with {len(unnamed)} unnamed and {len(lru)} cached free blocks")
            else:
                got = a.allocate(k)
                log.append(f"allocate({k}) -> {got}")
                if not (len(got) == k and len(set(got)) == k and all(refs[b] == 0 for b in got)):
                    fail(f"allocate({k}) returned {got}: {k} distinct blocks nobody owns (owned: {sorted(set(owned))})")
                n_evict = max(0, k - len(unnamed))
                evicted = [b for b in got if b not in unnamed]
                if sorted(evicted) != sorted(lru[:n_evict]):
                    fail(f"allocate({k}) with unnamed free blocks {unnamed} and cached ones {lru} (least recently "
                         f"freed first) evicted {evicted}; expected {lru[:n_evict]}: unnamed blocks first, then the "
                         f"least recently freed")
                for b in lru[:n_evict]:
                    del names[b]
                del lru[:n_evict]
                for b in got:
                    refs[b] = 1
                owned += got
        elif op == "f" and owned:
            picks = rng.sample(range(len(owned)), rng.randint(1, min(3, len(owned))))
            blocks = [owned[i] for i in picks]
            log.append(f"free({blocks})")
            a.free(blocks)
            for i in sorted(picks, reverse=True):
                del owned[i]
            for b in blocks:
                refs[b] -= 1
                if refs[b] == 0 and b in names:
                    lru.append(b)
        elif op == "r" and owned:
            b, name = rng.choice(owned), rng.choice(pool)
            fresh = b not in names and name not in names.values()
            a.register(b, name)  # given
            log.append(f"register({b}, n{pool.index(name)})")
            if fresh:
                names[b] = name
        elif op == "s" and names:
            b = rng.choice(sorted(names))
            _grader_acquire(a, [b])
            log.append(f"acquire([{b}])")
            if refs[b] == 0:
                lru.remove(b)
            refs[b] += 1
            owned.append(b)
        elif op == "d":
            unowned = [b for b in range(n) if refs[b] == 0]
            if unowned:
                bad = [rng.choice(unowned)] + ([rng.choice(owned)] if owned and rng.random() < 0.5 else [])
                rng.shuffle(bad)
                log.append(f"free({bad}) (a double free)")
                must_refuse_free(a, bad, f"of block(s) nobody owns {[b for b in bad if refs[b] == 0]}")
        got_refs = [a.ref_count(b) for b in range(n)]
        if got_refs != refs:
            fail(f"ref counts {got_refs}, expected {refs}")
        if a.num_free() != refs.count(0):
            fail(f"num_free() = {a.num_free()}, but {refs.count(0)} blocks have no owner (cached ones count)")
        if a._name_of != names or a._block_of != {v: k for k, v in names.items()}:
            fail(f"the cached names differ: blocks named {sorted(a._name_of)}, expected {sorted(names)} (a freed named "
                 f"block keeps its name; an evicted one forgets it, in _block_of and _name_of)")
        if sorted(a._evictable) != sorted(lru) or sorted(a._free) != [b for b in range(n)
                                                                      if refs[b] == 0 and b not in names]:
            fail(f"_evictable {list(a._evictable)} and _free {list(a._free)}: unowned named blocks belong in "
                 f"_evictable ({sorted(lru)}), unowned unnamed ones in _free, owned ones in neither")


# ========================================================================================= the real model, cached

SYSTEM_A = "You are a helpful assistant who answers in one short sentence. " * 6
SYSTEM_B = "Talk like a pirate captain on the high seas, and never use more than ten words. " * 5
CONVERSATIONS = {
    "c0": [{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": "What is the capital of France?"}],
    "c1": [{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": "What is 2 + 2?"}],
    "c2": [{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": "Name a primary colour."}],
    "b0": [{"role": "system", "content": SYSTEM_B}, {"role": "user", "content": "Where is the treasure?"}],
}
PHASES = [["c0"], ["c1", "c2"], ["b0"], ["c0"]]  # served one phase after another on one engine
NUM_BLOCKS, BLOCK_SIZE = 10, 16
PARAMS = SamplingParams(max_tokens=8)
_reference: dict = {}


@one_thread
def serve_phases(model, tok) -> tuple[list[dict], object]:
    """Serve PHASES on one engine with prefix caching; per phase {conversation: greedy ids, 'hits': prompt tokens
    served from the cache, 'evictions': blocks evicted}."""
    llm = minillm.LLM.from_model(model, tok, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    out = []
    for phase in PHASES:
        stats = llm.prefix_cache_stats
        hits, evictions = stats.hit_tokens, stats.evictions
        ids = {name: llm.add_request(tok.encode_chat(CONVERSATIONS[name]), PARAMS) for name in phase}
        for _ in range(200):
            if not llm.has_unfinished():
                break
            llm.step()
        else:
            raise AssertionError(f"phase {phase}: the engine did not finish in 200 steps ({llm.num_free_blocks()} of "
                                 f"{NUM_BLOCKS} blocks free): are freed blocks handed out again?")
        got = {name: llm.pop_output(r).token_ids for name, r in ids.items()}
        got["hits"], got["evictions"] = stats.hit_tokens - hits, stats.evictions - evictions
        out.append(got)
    return out, llm


def reference_phases(model, tok) -> list[dict]:
    """minillm's own engine: the answers without prefix caching (all four conversations at once, on a pool that
    never preempts), the hits and evictions of each phase with it (cached per model)."""
    if id(model) not in _reference:
        plain = minillm.LLM.from_model(model, tok, num_blocks=64, block_size=BLOCK_SIZE)
        answers = dict(zip(CONVERSATIONS, (o.token_ids for o in one_thread(plain.chat)(
            list(CONVERSATIONS.values()), PARAMS))))
        cached, _ = serve_phases(model, tok)
        assert all(c[name] == answers[name] for c, phase in zip(cached, PHASES) for name in phase), (
            "grader self-check: minillm's prefix cache changed an answer")
        assert cached[1]["hits"] > 0 and cached[2]["evictions"] > 0 and cached[3]["hits"] > 0, (
            f"grader self-check: the phases must hit, evict and hit again ({cached})")
        _reference[id(model)] = [{**{name: answers[name] for name in phase}, "hits": c["hits"],
                                  "evictions": c["evictions"]} for c, phase in zip(cached, PHASES)]
    return _reference[id(model)]


@pytest.mark.task_12_real_model
def test_your_prefix_cache_serves_smollm2(real_model, monkeypatch):
    """Your block_hashes in the engine's BlockManager, your PrefixCachingAllocator in its paged cache: four phases of
    SmolLM2-135M chat requests (c0; c1 and c2, which share c0's system prompt, at once; b0, with another system
    prompt, which does not fit without evicting; c0 again) on a 10-block pool of 16 tokens. Every answer is the
    engine's greedy answer without prefix caching; every phase hits as many prompt tokens and evicts as many blocks
    as minillm's prefix cache; every block is back at the end."""
    model, tok = real_model
    block_manager = importlib.import_module("minillm.engine.block_manager")
    engine = importlib.import_module("minillm.engine.llm")
    calls = Counter()

    def your_block_hashes(*args, **kwargs):
        calls["block_hashes"] += 1
        return impl.block_hashes(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(block_manager, "block_hashes", your_block_hashes)
        m.setattr(engine, "PrefixCachingAllocator", impl.PrefixCachingAllocator)
        got, llm = serve_phases(model, tok)
    assert isinstance(llm.cache.allocator, impl.PrefixCachingAllocator) and calls["block_hashes"], (
        "your PrefixCachingAllocator / block_hashes were not used: is minillm.engine.llm / "
        "minillm.engine.block_manager unchanged?")
    want = reference_phases(model, tok)
    for i, (g, w) in enumerate(zip(got, want)):
        phase = f"phase {i + 1} ({' and '.join(PHASES[i])})"
        wrong = [name for name in PHASES[i] if g[name] != w[name]]
        if g["hits"] != w["hits"]:
            why = ("fewer: a block that minillm's cache still holds was evicted, lost its name on free, or was not "
                   "found by match" if g["hits"] < w["hits"] else
                   "more: a block was served that minillm's cache no longer holds (an evicted block whose name was "
                   "not forgotten, or a match past a missing name): its keys and values belong to another prefix")
            raise AssertionError(f"{phase}: your cache served {g['hits']} prompt tokens, minillm's {w['hits']}; {why}"
                                 f"{'; and the answers differ: ' + ', '.join(wrong) if wrong else ''}")
        for name in PHASES[i]:
            same_tokens(g[name], w[name], tok, f"{phase}: request {name} with your prefix cache")
        assert g["evictions"] == w["evictions"], (
            f"{phase}: {g['evictions']} evictions counted (stats.evictions), minillm's cache made {w['evictions']}: "
            f"evict only when no unnamed block is free, one per block taken from the LRU list")
    alloc = llm.cache.allocator
    assert llm.num_free_blocks() == NUM_BLOCKS and all(alloc.ref_count(b) == 0 for b in range(NUM_BLOCKS)), (
        f"every request finished, but only {llm.num_free_blocks()} of {NUM_BLOCKS} blocks are free (ref counts "
        f"{[alloc.ref_count(b) for b in range(NUM_BLOCKS)]})")
    print(f"\nhits per phase {[g['hits'] for g in got]}, evictions {[g['evictions'] for g in got]}")
