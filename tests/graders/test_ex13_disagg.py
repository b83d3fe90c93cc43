"""Grader for exercise 13: the KV-block transfer of disaggregated serving, and routing requests across replicas.

Everything is compared with oracles written here, not with minillm.cache.kv_transfer or minillm.cluster.router. pack
and unpack: `oracle_pack` copies one pool block at a time (a Python loop over the table) and the receiver's expected
state is built the same way; crafted pools (several layers, scattered and reversed tables, a partial last block, an
int8 pool with its float16 scales, a receiver with other contents in every other block) say which rule a wrong
answer breaks, then hypothesis draws shapes, tables and token counts. The router: crafted ReplicaStates (loads in
tokens vs in requests, ties, dead replicas), crafted memories and request streams (the leading run of hashes, the
longest match, a prompt shorter than a block, both balance thresholds at their boundaries, the LRU bound), then
random streams against `OracleRouter`, a plain-list model of the memory and the rules.

The real-model task runs SmolLM2-135M (float32) through your code in one process: your pack_kv_blocks and
unpack_kv_blocks take the place of minillm.cache.kv_transfer's while LLM.add_prefill runs on one engine and
LLM.add_prefilled on a second whose free blocks come in a scrambled order (so the KV lands in other, unsorted block
ids): the greedy tokens of one engine, float32 and int8 KV. Then your PrefixAffinityRouter routes chat requests
that share system prompts over two prefix-caching engines, in waves (loads in flight): the same replica choices and
the same prefix-cache hits per engine as minillm's PrefixAffinityRouter.
"""

from __future__ import annotations

import importlib
import random
from collections import OrderedDict
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minillm
from minillm.cache.kv_pool import KVBlockPool, KVCacheSpec
from minillm.cache.prefix_cache import block_hashes
from minillm.cluster.router import ReplicaState, RequestLoad
from minillm.sampling import SamplingParams
from tests.graders.conftest import forbid_calls, load_impl
from tests.graders.real_model import one_thread, same_tokens

impl = load_impl("ex13_disagg")
PACK_LIBRARY = ["minillm", "kv_transfer", "export_blocks", "import_blocks", "pack_kv_blocks", "unpack_kv_blocks"]
ROUTE_LIBRARY = ["minillm", "router", "LeastOutstandingTokensRouter"]


# ================================================================================================= task 13.pack

def make_pool(n_layers=3, n_kv_heads=2, head_dim=4, num_blocks=8, block_size=4, int8=False, seed=0,
              fill=None) -> KVBlockPool:
    """A pool whose every element is distinct-ish (random), or `fill` everywhere (a receiver's sentinel)."""
    spec = KVCacheSpec(n_layers, n_kv_heads, head_dim, num_blocks, block_size,
                       kv_dtype=torch.int8 if int8 else None)
    pool = KVBlockPool(spec)
    g = torch.Generator().manual_seed(seed)
    for t in tensors_of(pool).values():
        if fill is not None:
            t.fill_(fill)
        elif t.dtype == torch.int8:
            t.copy_(torch.randint(-127, 128, t.shape, generator=g, dtype=torch.int8))
        else:
            t.copy_((torch.rand(t.shape, generator=g) + 0.01).to(t.dtype))
    return pool


def tensors_of(pool: KVBlockPool) -> dict:
    """The pool's storage by payload name (the grader's own list)."""
    out = {"k": pool.k, "v": pool.v}
    if pool.k_scale is not None:
        out.update(k_scale=pool.k_scale, v_scale=pool.v_scale)
    return out


def snapshot(pool: KVBlockPool) -> dict:
    return {n: t.clone() for n, t in tensors_of(pool).items()}


def oracle_pack(pool: KVBlockPool, table: list[int], num_tokens: int) -> dict:
    """Block by block: packed block i is pool block table[i], every layer; ceil(num_tokens / block_size) blocks."""
    n_blocks = (num_tokens + pool.spec.block_size - 1) // pool.spec.block_size
    out = {}
    for name, t in tensors_of(pool).items():
        out[name] = torch.stack([t[:, table[i]].clone() for i in range(n_blocks)], dim=1)
    return out


def oracle_unpack(before: dict, table: list[int], payload: dict) -> dict:
    """The receiver's tensors after the payload's block i is written into block table[i] (nothing else changes)."""
    after = {n: t.clone() for n, t in before.items()}
    for name, t in after.items():
        for i, block in enumerate(table):
            t[:, block] = payload[name][:, i]
    return after


def call_pack(pool, table, num_tokens) -> dict:
    before = snapshot(pool)
    got = impl.pack_kv_blocks(pool, list(table), num_tokens)
    what = f"pack_kv_blocks(pool, {table}, num_tokens={num_tokens})"
    assert isinstance(got, dict), f"{what} returned {type(got).__name__}; expected a dict of tensors by name"
    for name, t in snapshot(pool).items():
        assert torch.equal(t, before[name]), f"{what} changed the pool's {name!r}: pack only reads"
    return got


def check_payload_equal(got: dict, want: dict, what: str, block_size: int, table: list[int]) -> None:
    assert set(got) == set(want), (
        f"{what}: the payload holds {sorted(got)}, expected {sorted(want)}"
        + (": an int8 pool's scales (k_scale, v_scale) must travel with it, else the receiver dequantizes with the "
           "wrong scales" if "k_scale" in want else ""))
    for name, w in want.items():
        g = got[name]
        assert isinstance(g, torch.Tensor) and g.dtype == w.dtype, (
            f"{what}: {name!r} is {getattr(g, 'dtype', type(g).__name__)}, expected {w.dtype} (the pool's dtype)")
        if g.shape != w.shape:
            hint = ""
            if g.ndim == w.ndim and g.shape[1] == w.shape[1] - 1:
                hint = (f": one block too few. {what} needs ceil(num_tokens / {block_size}) blocks: the last, partly "
                        f"filled block is sent too (floor drops the last tokens' keys and values)")
            raise AssertionError(f"{what}: {name!r} has shape {tuple(g.shape)}, expected {tuple(w.shape)} "
                                 f"(n_layers, n_blocks, ...the pool's other dims){hint}")
        if not torch.equal(g, w):
            layer, block = next((l, b) for l in range(w.shape[0]) for b in range(w.shape[1])
                                if not torch.equal(g[l, b], w[l, b]))
            raise AssertionError(f"{what}: {name!r} layer {layer}, packed block {block} is not pool block "
                                 f"{table[block]} (block_table[{block}]): packed block i holds block_table[i], in the "
                                 f"table's order, for every layer")


@pytest.mark.task_13_pack
def test_pack_crafted():
    forbid_calls(impl.pack_kv_blocks, PACK_LIBRARY)
    pool = make_pool(n_layers=3, num_blocks=8, block_size=4)
    for table, n in [([5, 2, 7], 12), ([5, 2, 7], 10), ([5, 2, 7], 9), ([6], 1), ([0, 1, 2, 3], 16),
                     ([7, 6, 5, 4, 3, 2, 1, 0], 32), ([3, 1, 4, 0], 5), ([2], 4)]:
        got = call_pack(pool, table, n)
        check_payload_equal(got, oracle_pack(pool, table, n), f"pack_kv_blocks(pool, {table}, num_tokens={n})", 4,
                            table)
    # more blocks in the table than the tokens need: only the first ceil(n / block_size) are packed
    got = call_pack(pool, [1, 3, 5, 7], 5)
    check_payload_equal(got, oracle_pack(pool, [1, 3, 5], 5), "pack_kv_blocks(pool, [1, 3, 5, 7], num_tokens=5)",
                        4, [1, 3, 5])


@pytest.mark.task_13_pack
def test_pack_int8_pool_carries_its_scales():
    pool = make_pool(n_layers=2, num_blocks=6, block_size=4, int8=True, seed=1)
    for table, n in [([4, 0, 2], 11), ([5], 3), ([1, 0], 8)]:
        got = call_pack(pool, table, n)
        check_payload_equal(got, oracle_pack(pool, table, n), f"int8 pool: pack_kv_blocks(pool, {table}, {n})", 4,
                            table)


@pytest.mark.task_13_pack
def test_pack_returns_copies():
    """The prefill engine frees the request's blocks once its KV is packed; the next request overwrites them while
    the payload is still on its way (or waiting in the decode engine's queue)."""
    for table in ([0, 1, 2], [2, 3], [4, 1, 6]):
        pool = make_pool(num_blocks=8, block_size=4, int8=True, seed=2)
        got = call_pack(pool, table, 4 * len(table))
        want = {n: t.clone() for n, t in got.items()}
        for t in tensors_of(pool).values():
            t.fill_(3)  # the blocks handed to another request and written
        for name, t in got.items():
            assert torch.equal(t, want[name]), (
                f"pack_kv_blocks(pool, {table}, ...): writing the pool after pack changed the payload's {name!r}: "
                f"it is a view of the pool (slicing t[:, a:b] shares memory); gather into new memory (indexing "
                f"with a tensor of block ids, index_select, or .clone())")
            assert t.is_contiguous(), f"pack_kv_blocks: the payload's {name!r} is not contiguous"
        before = snapshot(pool)
        for t in got.values():
            t.fill_(5)
        for name, t in tensors_of(pool).items():
            assert torch.equal(t, before[name]), (
                f"pack_kv_blocks(pool, {table}, ...): writing the payload changed the pool's {name!r}: the payload "
                f"shares memory with the pool")


@pytest.mark.task_13_pack
def test_pack_refuses_bad_token_counts():
    pool = make_pool(num_blocks=8, block_size=4)
    for table, n, why in [([1, 2], 0, "no token to pack"), ([1, 2], -3, "a negative token count"),
                          ([1, 2], 9, "9 tokens do not fit in 2 blocks of 4"), ([], 1, "an empty block table")]:
        with pytest.raises(ValueError):
            impl.pack_kv_blocks(pool, table, n)
            raise AssertionError(f"pack_kv_blocks(pool, {table}, num_tokens={n}) returned: {why} is a ValueError")


def call_unpack(pool, table, payload, want_after: dict, what: str) -> None:
    impl.unpack_kv_blocks(pool, list(table), payload)
    for name, w in want_after.items():
        got = tensors_of(pool)[name]
        if torch.equal(got, w):
            continue
        bad = [b for b in range(w.shape[1]) if not torch.equal(got[:, b], w[:, b])]
        if bad and all(b not in table for b in bad):
            raise AssertionError(f"{what}: {name!r} of blocks {bad} changed, and they are not in the table {table}: "
                                 f"unpack writes only the table's blocks (the others hold other requests' KV)")
        block = bad[0]
        i = table.index(block)
        src = [j for j in range(payload[name].shape[1]) if torch.equal(got[:, block], payload[name][:, j])]
        if src:
            raise AssertionError(f"{what}: block {block} (block_table[{i}]) holds packed block {src[0]}, expected "
                                 f"packed block {i}: packed block i goes to block_table[i], in the table's order "
                                 f"(not sorted by id)")
        if name.endswith("scale") and torch.equal(got[:, block], w[:, block] * 0 + got[:, block].flatten()[0]):
            raise AssertionError(f"{what}: the {name!r} of block {block} were not written: an int8 payload's scales "
                                 f"must be unpacked too, else the receiver dequantizes its keys with stale scales")
        raise AssertionError(f"{what}: {name!r} of block {block} (block_table[{i}]) is not packed block {i}")


@pytest.mark.task_13_pack
@pytest.mark.parametrize("int8", [False, True])
def test_unpack_crafted(int8):
    forbid_calls(impl.unpack_kv_blocks, PACK_LIBRARY)
    src = make_pool(n_layers=3, num_blocks=8, block_size=4, int8=int8, seed=3)
    table = [6, 1, 3]
    payload = oracle_pack(src, table, 10)
    for dst_table in ([9, 2, 5], [0, 1, 2], [4, 11, 7], [11, 10, 9]):
        dst = make_pool(n_layers=3, num_blocks=12, block_size=4, int8=int8, fill=7)
        what = f"unpack_kv_blocks(pool of 12 blocks, {dst_table}, payload of 3 blocks{', int8' if int8 else ''})"
        call_unpack(dst, dst_table, payload, oracle_unpack(snapshot(dst), dst_table, payload), what)
    # a receiver whose every block holds something else: only the table's blocks change
    dst = make_pool(n_layers=3, num_blocks=12, block_size=4, int8=int8, seed=4)
    call_unpack(dst, [8, 0, 5], payload, oracle_unpack(snapshot(dst), [8, 0, 5], payload),
                "unpack_kv_blocks into a full pool, blocks [8, 0, 5]")
    # a round trip: the receiver packs back what the sender packed
    back = oracle_pack(dst, [8, 0, 5], 10)
    assert all(torch.equal(back[n], payload[n]) for n in payload), "after unpack, the blocks must hold the payload"


@pytest.mark.task_13_pack
def test_unpack_refuses_what_does_not_fit():
    src = make_pool(num_blocks=8, block_size=4, seed=5)
    payload = oracle_pack(src, [3, 1], 8)
    int8_payload = oracle_pack(make_pool(num_blocks=8, block_size=4, int8=True, seed=6), [3, 1], 8)
    cases = [
        (make_pool(num_blocks=8, block_size=4, fill=2), [4], payload, "2 packed blocks, 1 block id"),
        (make_pool(num_blocks=8, block_size=4, fill=2), [4, 5, 6], payload, "2 packed blocks, 3 block ids"),
        (make_pool(num_blocks=8, block_size=4, fill=2), [4, 5], int8_payload, "an int8 payload, a float pool"),
        (make_pool(num_blocks=8, block_size=4, int8=True, fill=2), [4, 5], payload, "a float payload, an int8 pool"),
        (make_pool(num_blocks=8, block_size=2, fill=2), [4, 5], payload, "blocks of 4 tokens, a pool of 2"),
        (make_pool(num_blocks=8, block_size=4, n_kv_heads=3, fill=2), [4, 5], payload, "2 KV heads, a pool of 3"),
        (make_pool(num_blocks=8, block_size=4, n_layers=2, fill=2), [4, 5], payload, "3 layers, a pool of 2"),
        (make_pool(num_blocks=8, block_size=4, fill=2), [4, 5], {n: t.half() for n, t in payload.items()},
         "a float16 payload, a float32 pool"),
        (make_pool(num_blocks=8, block_size=4, fill=2), [4, 5], {"k": payload["k"]}, "no 'v' in the payload"),
    ]
    for dst, table, bad, why in cases:
        before = snapshot(dst)
        with pytest.raises(ValueError):
            impl.unpack_kv_blocks(dst, table, bad)
            raise AssertionError(f"unpack_kv_blocks({table}, ...) accepted {why}: a ValueError (check_payload)")
        assert all(torch.equal(t, before[n]) for n, t in tensors_of(dst).items()), (
            f"unpack_kv_blocks refused {why} but wrote into the pool first: check before writing")


@pytest.mark.task_13_pack
@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.sampled_from([1, 2, 8]), st.sampled_from([1, 2, 4, 16]),
       st.booleans(), st.integers(0, 10**6), st.data())
def test_pack_unpack_random(n_layers, n_kv_heads, head_dim, block_size, int8, seed, data):
    rng = random.Random(seed)
    src = make_pool(n_layers, n_kv_heads, head_dim, num_blocks=6, block_size=block_size, int8=int8, seed=seed)
    table = rng.sample(range(6), rng.randint(1, 6))
    n = data.draw(st.integers(1, len(table) * block_size), label="num_tokens")
    got = call_pack(src, table, n)
    want = oracle_pack(src, table, n)
    what = f"pack_kv_blocks({n_layers} layers, {n_kv_heads} heads, head_dim {head_dim}, {table}, num_tokens={n})"
    check_payload_equal(got, want, what, block_size, table)
    dst = make_pool(n_layers, n_kv_heads, head_dim, num_blocks=9, block_size=block_size, int8=int8, seed=seed + 1)
    dst_table = rng.sample(range(9), len(want["k"][0]))
    call_unpack(dst, dst_table, want, oracle_unpack(snapshot(dst), dst_table, want), f"unpack_kv_blocks({dst_table})")


# ================================================================================================ task 13.route

def replica(i: int, loads: Sequence[int] = (), alive: bool = True) -> ReplicaState:
    """A replica with one in-flight request per load (each that many outstanding tokens: all of it output)."""
    r = ReplicaState(i, alive=alive)
    for j, tokens in enumerate(loads):
        r.in_flight[f"r{i}-{j}"] = RequestLoad(prompt_tokens=0, max_tokens=tokens)
    return r


def check_least(reps: list[ReplicaState], want: int, why: str) -> None:
    before = [(r.id, r.alive, r.outstanding_tokens) for r in reps]
    got = impl.least_loaded(reps)
    desc = ", ".join(f"{r.id}{'' if r.alive else ' (dead)'}: {r.num_in_flight} req / {r.outstanding_tokens} tok"
                     for r in reps)
    assert isinstance(got, ReplicaState), (
        f"least_loaded([{desc}]) returned {got!r}: expected the ReplicaState itself (not its id)")
    assert got.id == want, f"least_loaded([{desc}]) chose replica {got.id}, expected {want}: {why}"
    assert [(r.id, r.alive, r.outstanding_tokens) for r in reps] == before, "least_loaded changed the replicas"


@pytest.mark.task_13_route
def test_least_loaded_crafted():
    forbid_calls(impl.least_loaded, ROUTE_LIBRARY)
    check_least([replica(0, [2000]), replica(1, [20, 20, 20])], 1,
                "the load is in tokens: one 2,000-token request owes more than three 20-token ones")
    check_least([replica(0, [5, 5]), replica(1, [40])], 0, "10 outstanding tokens is less than 40")
    check_least([replica(2, [10]), replica(0, [10]), replica(1, [10])], 0, "a tie goes to the lowest id")
    check_least([replica(3, [7]), replica(1, [30]), replica(2, [7])], 2, "a tie goes to the lowest id")
    check_least([replica(0, [], alive=False), replica(1, [100]), replica(2, [50])], 2,
                "a dead replica gets nothing, however idle it looks")
    check_least([replica(0, []), replica(1, [], alive=False)], 0, "the live one")
    progressed = replica(1, [])
    progressed.in_flight["x"] = RequestLoad(prompt_tokens=500, max_tokens=100, prefilled=500, generated=90)  # owes 10
    check_least([replica(0, [30]), progressed], 1, "replica 1's request has only 10 tokens left to generate")
    for reps in ([replica(0, alive=False), replica(1, alive=False)], []):
        with pytest.raises(RuntimeError):
            impl.least_loaded(reps)
            raise AssertionError(f"least_loaded with {len(reps)} replicas, none alive, returned: a RuntimeError "
                                 f"(a request must never be dropped silently)")


def router(**kw):
    cls = impl.PrefixAffinityRouter
    assert importlib.import_module("minillm.cluster.router").PrefixAffinityRouter not in cls.__mro__, (
        "your PrefixAffinityRouter subclasses minillm's: write the methods yourself")
    for m in ("matched_blocks", "is_imbalanced", "choose", "on_dispatch"):
        assert m in vars(cls), f"PrefixAffinityRouter.{m} must be written in your class"
    forbid_calls(cls, ROUTE_LIBRARY)
    return cls(**kw)


BS = 4  # the block size of the crafted prompts


def prompt(prefix: int, n_blocks: int, tail: int = 0, tail_tokens: int = 0) -> list[int]:
    """n_blocks full blocks of prefix `prefix`, then tail_tokens tokens of tail `tail`."""
    return [1000 * prefix + i for i in range(n_blocks * BS)] + [50000 + 100 * tail + i for i in range(tail_tokens)]


def check_choice(r, p, reps, want: int, why: str) -> None:
    remembered = [r.num_remembered(x.id) for x in reps]
    got = r.choose(p, 16, reps)
    desc = ", ".join(f"{x.id}{'' if x.alive else ' (dead)'}: {x.outstanding_tokens} tok, "
                     f"{r.num_remembered(x.id)} blocks remembered, "
                     f"{r.matched_blocks(x.id, block_hashes(p, r.block_size))} matched" for x in reps)
    assert isinstance(got, int) and not isinstance(got, bool), f"choose returned {got!r}: expected a replica id"
    assert got == want, f"choose({len(p)} tokens) over [{desc}] chose replica {got}, expected {want}: {why}"
    assert [r.num_remembered(x.id) for x in reps] == remembered, (
        "choose changed what the router remembers: choose only reads; on_dispatch remembers once the request is sent")


def dispatch(r, reps, i: int, p: list[int], max_tokens: int = 16) -> None:
    reps[i].on_dispatch(f"req{sum(x.num_in_flight for x in reps)}-{i}", len(p), max_tokens)
    r.on_dispatch(i, p)


@pytest.mark.task_13_route
def test_matched_blocks_counts_the_leading_run():
    r = router(block_size=BS)
    h = block_hashes(prompt(1, 4), BS)
    r._seen[0] = OrderedDict.fromkeys([h[0], h[2], h[3]])
    r._seen[1] = OrderedDict.fromkeys(h[:2])
    for rid, hashes, want, why in [
        (0, h, 1, ("block 1 is not remembered: blocks 2 and 3 after it do not count (the engine reads a sequence's "
                   "cache from its first block: a block after a missing one is recomputed anyway)")),
        (1, h, 2, "the first two"), (1, h[:1], 1, "one hash, remembered"), (0, [], 0, "no hashes"),
        (2, h, 0, "replica 2 was never sent anything"), (0, h[1:], 0, "the first hash (block 1) is not remembered"),
    ]:
        got = r.matched_blocks(rid, hashes)
        assert got == want, f"matched_blocks(replica {rid}, {len(hashes)} hashes) = {got}, expected {want}: {why}"


@pytest.mark.task_13_route
def test_on_dispatch_remembers_full_blocks_heads_most_recent():
    r = router(block_size=BS, max_blocks=100)
    p = prompt(1, 3, tail_tokens=3)
    r.on_dispatch(0, p)
    h = block_hashes(p, BS)
    assert r.num_remembered(0) == 3, (
        f"on_dispatch of {len(p)} tokens in blocks of {BS}: 3 full blocks, so 3 hashes remembered (a partial block "
        f"has none), not {r.num_remembered(0)}")
    assert set(r._seen[0]) == set(h), "on_dispatch must remember block_hashes(prompt_ids, block_size)"
    assert list(r._seen[0]) == h[::-1], (
        "after on_dispatch the prompt's first block must be the most recently used (last in _seen), its last block "
        "the least: insert the hashes tail first, so that the LRU bound drops a chain's tail before its head")
    assert r.matched_blocks(0, h) == 3 and r.num_remembered(1) == 0
    r.on_dispatch(0, prompt(1, 3, tail=1, tail_tokens=3))  # the same blocks again: nothing new
    assert r.num_remembered(0) == 3, "dispatching the same blocks again must not remember them twice"
    r.on_dispatch(0, prompt(1, 1, tail_tokens=2))
    assert list(r._seen[0])[-1] == h[0], "a hash dispatched again becomes the most recently used"


@pytest.mark.task_13_route
def test_lru_bound_keeps_heads_and_drops_tails():
    r = router(block_size=BS, max_blocks=3)
    long = prompt(1, 5)
    r.on_dispatch(0, long)
    h = block_hashes(long, BS)
    assert r.num_remembered(0) == 3, f"max_blocks=3: at most 3 hashes per replica, {r.num_remembered(0)} remembered"
    assert r.matched_blocks(0, h) == 3, (
        f"a 5-block prompt under max_blocks=3 must keep its first 3 blocks (its head: only a chain's head ever "
        f"matches); {r.matched_blocks(0, h)} leading blocks are remembered")
    r2 = router(block_size=BS, max_blocks=4)
    a, b, c = prompt(1, 2), prompt(2, 2), prompt(3, 2)
    for p in (a, b, a, c):  # a is used again after b: b is now the least recently used
        r2.on_dispatch(0, p)
    ha, hb, hc = (block_hashes(p, BS) for p in (a, b, c))
    assert r2.num_remembered(0) == 4
    assert r2.matched_blocks(0, ha) == 2 and r2.matched_blocks(0, hc) == 2 and r2.matched_blocks(0, hb) == 0, (
        f"max_blocks=4, prompts a, b, a again, c (2 blocks each): b is the least recently used and is dropped; "
        f"remembered blocks: a {r2.matched_blocks(0, ha)}, b {r2.matched_blocks(0, hb)}, "
        f"c {r2.matched_blocks(0, hc)} (expected 2, 0, 2): a hash dispatched again moves to the most recent end")
    r2.on_dispatch(1, prompt(4, 6))
    assert r2.num_remembered(1) == 4 and r2.num_remembered(0) == 4, "the bound is per replica"


@pytest.mark.task_13_route
def test_choose_crafted_stream():
    r = router(block_size=BS, balance_abs=10_000)
    reps = [replica(0), replica(1)]
    check_choice(r, prompt(1, 3, 1, 2), reps, 0, "nothing matches anywhere: the least loaded (a tie: lowest id)")
    dispatch(r, reps, 0, prompt(1, 3, 1, 2))
    check_choice(r, prompt(1, 3, 2, 2), reps, 0,
                 "the same 3-block prefix was sent to replica 0: send it there again (its cache holds the prefix)")
    check_choice(r, prompt(2, 3, 1, 2), reps, 1, "another prefix, no match: the least loaded replica")
    dispatch(r, reps, 1, prompt(2, 3, 1, 2))
    check_choice(r, prompt(2, 3, 3, 2), reps, 1, "prefix 2 went to replica 1")
    check_choice(r, prompt(1, 3, 3, 2), reps, 0, "prefix 1 went to replica 0")
    # the longest match wins, even on the busier replica (within the thresholds)
    r = router(block_size=BS, balance_abs=10_000)
    reps = [replica(0), replica(1)]
    dispatch(r, reps, 0, prompt(1, 2))
    dispatch(r, reps, 1, prompt(1, 4))
    dispatch(r, reps, 1, prompt(9, 1))
    check_choice(r, prompt(1, 4, 1, 1), reps, 1, "replica 1 holds 4 blocks of the prefix, replica 0 only 2")
    check_choice(r, prompt(1, 2, 1, 1), reps, 0,
                 "both hold the prompt's 2 full blocks: the less loaded one (replica 0 owes fewer tokens)")
    # equal matches, equal loads: the lower id
    r = router(block_size=BS)
    reps = [replica(0), replica(1), replica(2)]
    for i in (2, 1):
        r.on_dispatch(i, prompt(1, 2))
    check_choice(r, prompt(1, 2), reps, 1, "replicas 1 and 2 match 2 blocks at the same load: the lower id")


@pytest.mark.task_13_route
def test_choose_block_alignment_and_fallback_ties():
    r = router(block_size=16)
    reps = [replica(0, [50]), replica(1)]
    short = list(range(100, 110))  # 10 tokens: less than one block of 16
    r.on_dispatch(0, short)
    check_choice(r, short, reps, 1, "a prompt shorter than one block has no full block, so no hash: it matches "
                                    "nothing (even the same prompt) and goes to the least loaded replica")
    # no match: the lightest; among equally loaded ones the one remembering fewer blocks, then the lower id
    r = router(block_size=BS)
    reps = [replica(0), replica(1), replica(2)]
    r.on_dispatch(0, prompt(1, 3))
    r.on_dispatch(1, prompt(2, 1))
    check_choice(r, prompt(5, 2), reps, 2, "a new prefix, all idle: the replica remembering the fewest blocks")
    r.on_dispatch(2, prompt(3, 2))
    check_choice(r, prompt(5, 2), reps, 1, "a new prefix, all idle: the replica remembering the fewest blocks (1)")
    reps[1].on_dispatch("x", 0, 5)
    check_choice(r, prompt(5, 2), reps, 2, "a new prefix: the least loaded first (1 owes 5 tokens), then the fewest "
                                           "remembered blocks")


@pytest.mark.task_13_route
def test_choose_falls_back_when_imbalanced():
    """The best match owes `a` tokens, the lightest replica `b`; fall back to the lightest iff a - b > balance_abs
    AND a > balance_rel * b."""
    p = prompt(1, 3, 1, 2)
    for a, b, want, why in [
        (150, 40, 1, "150 - 40 = 110 > 100 and 150 > 2 x 40: imbalanced, the lightest replica takes it"),
        (150, 60, 0, "150 - 60 = 90 is not > 100 (only the ratio 2.5 is): stay with the match"),
        (1200, 1000, 0, "1200 - 1000 = 200 > 100 but 1200 is not > 2 x 1000: stay with the match"),
        (140, 40, 0, "140 - 40 = 100 is not more than 100 (strictly): stay"),
        (2000, 1000, 0, "2000 is not more than 2 x 1000 (strictly): stay"),
        (2001, 1000, 1, "1001 > 100 and 2001 > 2000: fall back"),
        (101, 0, 1, "101 > 100 and 101 > 0: fall back"),
        (100, 0, 0, "100 is not more than 100: stay"),
    ]:
        r = router(block_size=BS, balance_abs=100, balance_rel=2.0)
        reps = [replica(0, [a]), replica(1, [b])]
        r.on_dispatch(0, p)
        assert r.is_imbalanced(reps[0], reps[1]) == (want == 1), (
            f"is_imbalanced(owes {a}, lightest owes {b}) with balance_abs=100, balance_rel=2.0 returned "
            f"{r.is_imbalanced(reps[0], reps[1])}: {why}")
        check_choice(r, p, reps, want, f"{why} (balance_abs=100, balance_rel=2.0)")


@pytest.mark.task_13_route
def test_choose_skips_dead_replicas():
    r = router(block_size=BS)
    p = prompt(1, 3)
    r.on_dispatch(0, p)
    r.on_dispatch(1, prompt(1, 2))
    reps = [replica(0, alive=False), replica(1, [30]), replica(2)]
    check_choice(r, p, reps, 1, "replica 0 holds the most but is dead: the best live match, replica 1")
    reps[1].alive = False
    check_choice(r, p, reps, 2, "no live replica matches: the least loaded live one")
    reps[2].alive = False
    with pytest.raises(RuntimeError):
        r.choose(p, 16, reps)
        raise AssertionError("choose with every replica dead returned: a RuntimeError (never drop a request)")


class OracleRouter:
    """The grader's model: per replica a list of hashes, least recently used first; the documented rules."""

    def __init__(self, block_size, max_blocks, balance_abs, balance_rel):
        self.bs, self.max, self.abs, self.rel = block_size, max_blocks, balance_abs, balance_rel
        self.mem: dict[int, list[bytes]] = {}

    def matched(self, i, hashes) -> int:
        mem, n = self.mem.get(i, []), 0
        for h in hashes:
            if h not in mem:
                break
            n += 1
        return n

    def choose(self, p, reps) -> int:
        hashes = block_hashes(p, self.bs)
        alive = [x for x in reps if x.alive]
        lightest = min(alive, key=lambda x: (x.outstanding_tokens, len(self.mem.get(x.id, [])), x.id))
        best = min(alive, key=lambda x: (-self.matched(x.id, hashes), x.outstanding_tokens, x.id))
        a, b = best.outstanding_tokens, lightest.outstanding_tokens
        if self.matched(best.id, hashes) == 0 or (a - b > self.abs and a > self.rel * b):
            return lightest.id
        return best.id

    def dispatch(self, i, p) -> None:
        mem = self.mem.setdefault(i, [])
        for h in reversed(block_hashes(p, self.bs)):
            if h in mem:
                mem.remove(h)
            mem.append(h)
        del mem[:max(0, len(mem) - self.max)]


@pytest.mark.task_13_route
@settings(max_examples=60, deadline=None)
@given(st.integers(2, 4), st.integers(2, 12), st.integers(0, 60), st.sampled_from([1.0, 1.5, 3.0]),
       st.integers(0, 10**6))
def test_route_random_streams(n_replicas, max_blocks, balance_abs, balance_rel, seed):
    rng = random.Random(seed)
    r = router(block_size=BS, max_blocks=max_blocks, balance_abs=balance_abs, balance_rel=balance_rel)
    oracle = OracleRouter(BS, max_blocks, balance_abs, balance_rel)
    reps = [replica(i) for i in range(n_replicas)]
    log = []
    for step in range(25):
        if rng.random() < 0.1:  # a replica dies or comes back (with an empty cache)
            x = rng.choice(reps)
            x.alive = not x.alive
            r.on_replica_down(x.id)
            oracle.mem.pop(x.id, None)
            log.append(f"replica {x.id} {'up' if x.alive else 'down'}")
        if not any(x.alive for x in reps):
            reps[0].alive = True
        if rng.random() < 0.3:  # a request finishes somewhere
            busy = [x for x in reps if x.in_flight]
            if busy:
                x = rng.choice(busy)
                x.on_finish(rng.choice(sorted(x.in_flight)))
        p = prompt(rng.randint(1, 3), rng.randint(0, 4), rng.randint(0, 3), rng.randint(0, 5))
        want = oracle.choose(p, reps)
        got = r.choose(p, 16, reps)
        log.append(f"choose(prefix {p[0] // 1000 if len(p) >= BS else None}, {len(p)} tokens; loads "
                   f"{[x.outstanding_tokens if x.alive else 'dead' for x in reps]}) -> {got}")
        assert got == want, (f"random stream (block_size {BS}, max_blocks {max_blocks}, balance_abs {balance_abs}, "
                             f"balance_rel {balance_rel}), step {step}: chose {got}, expected {want}\n  "
                             + "\n  ".join(log[-8:]))
        dispatch(r, reps, got, p, max_tokens=rng.randint(1, 40))
        oracle.dispatch(got, p)
        for x in reps:
            assert r.num_remembered(x.id) == len(oracle.mem.get(x.id, [])), (
                f"step {step}: replica {x.id} remembers {r.num_remembered(x.id)} blocks, expected "
                f"{len(oracle.mem.get(x.id, []))} (max_blocks {max_blocks})\n  " + "\n  ".join(log[-8:]))


# ===================================================================================== the real model, disaggregated

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name three primary colours."}],
    [{"role": "system", "content": "Answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
]
DISAGG_PARAMS = SamplingParams(max_tokens=8)
_reference: dict = {}


@one_thread
def single_engine(model, tok, kv_cache_dtype) -> list[list[int]]:
    llm = minillm.LLM.from_model(model, tok, num_blocks=32, kv_cache_dtype=kv_cache_dtype)
    return [o.token_ids for o in llm.chat(CHATS, DISAGG_PARAMS)]


@one_thread
def disaggregated(model, tok, kv_cache_dtype) -> tuple[list[list[int]], list[list[int]]]:
    """Prefill on one engine, decode on another whose free blocks come in a scrambled order; (tokens, the decode
    engine's block tables right after each add_prefilled)."""
    prefill = minillm.LLM.from_model(model, tok, num_blocks=16, kv_cache_dtype=kv_cache_dtype)
    decode = minillm.LLM.from_model(model, tok, num_blocks=24, kv_cache_dtype=kv_cache_dtype)
    alloc = decode.block_manager.allocator
    taken = alloc.allocate(24)
    alloc.free(random.Random(0).sample(taken, 24))  # handed out from now on in this scrambled order
    outs, tables = [], []
    for chat in CHATS:
        prefill.add_prefill(tok.encode_chat(chat), DISAGG_PARAMS)
        while prefill.has_unfinished():
            prefill.step()
        (handoff,) = prefill.pop_handoffs()
        rid = decode.add_prefilled(handoff)
        tables.append(list(decode._seqs[rid].block_table) if rid in decode._seqs else [])
        while decode.has_unfinished():
            decode.step()
        outs.append(decode.pop_output(rid).token_ids)
    assert prefill.num_free_blocks() == 16 and decode.num_free_blocks() == 24, "every block must be back"
    return outs, tables


# ============================================================================= the real model, routed over two engines

SYSTEM_A = "You are a helpful assistant who answers in one short sentence. " * 4
SYSTEM_B = "Talk like a pirate captain on the high seas, and never use more than ten words. " * 3
QUESTIONS = ["What is the capital of France?", "What is 2 + 2?", "Name a primary colour.", "Where is the treasure?",
             "Who wrote Hamlet?", "What is water made of?"]
WAVES = [[("A", 0), ("A", 1)], [("B", 3), ("A", 2), ("B", 0)], [("A", 4), ("B", 5), ("A", 0)], [("B", 1), ("A", 3)]]
ROUTE_PARAMS = SamplingParams(max_tokens=4)
ROUTER_KW = {"block_size": 16, "max_blocks": 24, "balance_abs": 64, "balance_rel": 1.5}


@one_thread
def route_stream(model, tok, router_cls) -> dict:
    """Serve WAVES over two prefix-caching engines: each wave's requests are routed one after another (the earlier
    ones of the wave in flight), then both engines run the wave to the end. Returns the choices, every answer, and
    each engine's prefix-cache hit tokens."""
    systems = {"A": SYSTEM_A, "B": SYSTEM_B}
    engines = [minillm.LLM.from_model(model, tok, num_blocks=24, block_size=16, enable_prefix_caching=True)
               for _ in range(2)]
    reps = [ReplicaState(0), ReplicaState(1)]
    r = router_cls(**ROUTER_KW)
    choices, answers = [], []
    for wave in WAVES:
        sent = []
        for system, q in wave:
            ids = tok.encode_chat([{"role": "system", "content": systems[system]},
                                   {"role": "user", "content": QUESTIONS[q]}])
            i = r.choose(ids, ROUTE_PARAMS.max_tokens, reps)
            rid = engines[i].add_request(ids, ROUTE_PARAMS)
            reps[i].on_dispatch(rid, len(ids), ROUTE_PARAMS.max_tokens)
            r.on_dispatch(i, ids)
            choices.append(i)
            sent.append((i, rid))
        for llm in engines:
            while llm.has_unfinished():
                llm.step()
        for i, rid in sent:
            answers.append(engines[i].pop_output(rid).token_ids)
            reps[i].on_finish(rid)
    return {"choices": choices, "answers": answers, "hits": [e.prefix_cache_stats.hit_tokens for e in engines]}


def reference(key, fn):
    if key not in _reference:
        _reference[key] = fn()
    return _reference[key]


@pytest.mark.task_13_real_model
def test_your_transfer_and_router_serve_smollm2(real_model, monkeypatch):
    """Your pack/unpack move SmolLM2-135M's KV from a prefill engine to a decode engine (float32 and int8 KV): the
    greedy tokens of one engine. Your PrefixAffinityRouter routes chat requests sharing system prompts over two
    prefix-caching engines: minillm's router's choices and prefix hits."""
    model, tok = real_model
    kv_transfer = importlib.import_module("minillm.cache.kv_transfer")
    router_module = importlib.import_module("minillm.cluster.router")
    want = {dt: reference(("single", id(model), dt), lambda dt=dt: single_engine(model, tok, dt))
            for dt in (None, "int8")}
    ref_route = reference(("route", id(model)), lambda: route_stream(model, tok, router_module.PrefixAffinityRouter))
    assert len(set(ref_route["choices"])) == 2 and min(ref_route["hits"]) > 0, (
        f"grader self-check: the stream must use both replicas and hit both caches ({ref_route})")
    calls = {"pack": 0, "unpack": 0}

    def your_pack(*a, **kw):
        calls["pack"] += 1
        return impl.pack_kv_blocks(*a, **kw)

    def your_unpack(*a, **kw):
        calls["unpack"] += 1
        return impl.unpack_kv_blocks(*a, **kw)

    with monkeypatch.context() as m:
        m.setattr(kv_transfer, "pack_kv_blocks", your_pack)
        m.setattr(kv_transfer, "unpack_kv_blocks", your_unpack)
        got = {dt: disaggregated(model, tok, dt) for dt in (None, "int8")}
    assert calls["pack"] == calls["unpack"] == 2 * len(CHATS), (
        f"your pack/unpack were called {calls} times, expected {2 * len(CHATS)} each: is minillm.engine.llm "
        f"unchanged (it calls kv_transfer.pack_kv_blocks / unpack_kv_blocks)?")
    for dt in (None, "int8"):
        outs, tables = got[dt]
        assert any(t != sorted(t) for t in tables), "grader self-check: the decode engine's tables must be unsorted"
        for chat, g, w, table in zip(CHATS, outs, want[dt], tables):
            same_tokens(g, w, tok, f"{chat[-1]['content']!r} prefilled on one engine and decoded on another "
                                   f"(KV {dt or 'float32'}, decode blocks {table}) with your pack/unpack")
    got_route = route_stream(model, tok, impl.PrefixAffinityRouter)
    for k, (g, w) in enumerate(zip(got_route["choices"], ref_route["choices"])):
        assert g == w, (f"request {k} of the stream went to replica {g}, minillm's router sent it to {w} "
                        f"(choices so far: yours {got_route['choices'][:k + 1]}, "
                        f"minillm's {ref_route['choices'][:k + 1]})")
    assert got_route["hits"] == ref_route["hits"], (
        f"prefix-cache hit tokens per engine {got_route['hits']}, with minillm's router {ref_route['hits']}")
    for g, w in zip(got_route["answers"], ref_route["answers"]):
        same_tokens(g, w, tok, "a routed request")
    print(f"\nchoices {got_route['choices']}, hit tokens per engine {got_route['hits']}")

