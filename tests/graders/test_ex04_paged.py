"""Grader for exercise 04: the block allocator, and the slots a paged cache writes and reads.

Allocator: seeded random sequences of allocate / fork (incref) / free run against a model of who owns which block;
after every step the ref counts, the free count and the free list must agree with the model. Plus the cases common
wrong answers get wrong: out of blocks (all or nothing, OutOfBlocksError), a shared block freed by one owner (must
stay allocated), double free (ValueError, nothing changed), no leaks.
Slots: the oracles here apply the rule position by position (position p of table T is slot T[p // block_size] *
block_size + p % block_size). Crafted cases with hand-computed slots (scattered block ids, a chunk that starts in the
middle of a block, decode steps on both sides of a block boundary, tables padded with -1, padding positions that
must point at position 0's slot with valid False), hypothesis over tables and lengths, and the engine's use: several
sequences grow through chunked prefill and decode steps, each step's new tokens are written into a pool at your
slot_mapping's slots and every context is read back through your context_slots, which must give each sequence's
tokens in order, as a contiguous cache holds them. The `*_rejects_wrong_answers` tests run the same checks on common
mistakes (skipped when grading exercises/).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.cache.block_allocator import OutOfBlocksError
from tests.graders.conftest import TARGET, forbid_calls, forbid_reference_imports, load_impl

impl = load_impl("ex04_paged")
grader_selftest = pytest.mark.skipif(TARGET == "exercises", reason="checks the grader itself, not your code")


# ============================================================================================= task 04.allocator


def _must_allocate(alloc, n):
    try:
        return alloc.allocate(n)
    except OutOfBlocksError as e:
        raise AssertionError(f"allocate({n}) failed with free blocks to spare (leaked blocks?): {e}") from e


def _agree(alloc, owners, num_blocks):
    refs: dict[int, int] = {}
    for blocks in owners:
        for b in blocks:
            refs[b] = refs.get(b, 0) + 1
    for b in range(num_blocks):
        assert alloc.ref_count(b) == refs.get(b, 0), (
            f"block {b}: ref count {alloc.ref_count(b)}, but {refs.get(b, 0)} owner(s) hold it")
    assert alloc.num_free() == num_blocks - len(refs), (
        f"num_free() = {alloc.num_free()}, but {num_blocks - len(refs)} blocks have no owner")


def check_allocator(cls) -> None:
    # handed out once each, ref count 1, all or nothing when out
    a = cls(6, 4)
    got = _must_allocate(a, 4)
    assert len(got) == 4 and len(set(got)) == 4 and all(0 <= b < 6 for b in got), f"allocate(4) gave {got}"
    assert all(a.ref_count(b) == 1 for b in got) and a.num_free() == 2
    try:
        a.allocate(3)
        raise AssertionError("allocate(3) with 2 free blocks must raise OutOfBlocksError")
    except OutOfBlocksError:
        pass
    assert a.num_free() == 2, "a failed allocate must allocate nothing (all or nothing)"
    rest = _must_allocate(a, 2)
    assert not set(rest) & set(got), "a block was handed out twice"

    # a shared block survives its first owner's free
    a = cls(4, 4)
    x, y = _must_allocate(a, 2)
    a.incref([x])
    a.free([x, y])
    assert a.ref_count(x) == 1, "freeing a shared block once must keep it allocated for its other owner"
    assert a.num_free() == 3 and x not in _must_allocate(a, 3), "a block still referenced was handed out again"

    # double free: ValueError, nothing changed
    a = cls(4, 4)
    x, y = _must_allocate(a, 2)
    a.free([x])
    try:
        a.free([y, x])
        raise AssertionError("freeing an already free block must raise ValueError")
    except ValueError:
        pass
    assert a.ref_count(y) == 1 and a.num_free() == 3, "a rejected free must change nothing"
    try:
        a.incref([x])
        raise AssertionError("incref of a free block must raise ValueError")
    except ValueError:
        pass

    # random sequences against a model of owners; everything comes back at the end
    for seed in range(8):
        rng = random.Random(seed)
        num_blocks = rng.choice([5, 12, 33])
        a, owners = cls(num_blocks, 16), []
        for _ in range(60):
            op = rng.random()
            if op < 0.45:
                n = rng.randint(0, 6)
                free = num_blocks - len({b for o in owners for b in o})
                if n > free:
                    try:
                        a.allocate(n)
                        raise AssertionError(f"allocate({n}) with {free} free blocks must raise OutOfBlocksError")
                    except OutOfBlocksError:
                        pass
                else:
                    got = _must_allocate(a, n)
                    assert len(set(got)) == n, f"allocate({n}) returned {got}"
                    assert not set(got) & {b for o in owners for b in o}, "a block in use was handed out again"
                    owners.append(got)
            elif op < 0.6 and owners:
                blocks = owners[rng.randrange(len(owners))]
                a.incref(blocks)
                owners.append(list(blocks))
            elif owners:
                a.free(owners.pop(rng.randrange(len(owners))))
            _agree(a, owners, num_blocks)
        for blocks in owners:
            a.free(blocks)
        assert a.num_free() == num_blocks, f"{num_blocks - a.num_free()} blocks leaked after everything was freed"
        assert sorted(_must_allocate(a, num_blocks)) == list(range(num_blocks)), "the free list lost or doubled ids"


@pytest.mark.task_04_allocator
def test_allocator():
    check_allocator(impl.BlockAllocator)
    forbid_reference_imports(impl.BlockAllocator)


# deliberately wrong allocators, built on the reference one -------------------------------------------------------

from solutions.ex04_paged import BlockAllocator as _Ref


class _FreeIgnoresRefCount(_Ref):  # frees a shared block while a fork still uses it
    def free(self, block_ids):
        for i in block_ids:
            if self._ref_counts[i] == 0:
                raise ValueError("double free")
            self._ref_counts[i] = 0
            self._free.append(i)


class _LeaksOnFree(_Ref):  # forgets to put blocks back on the free list
    def free(self, block_ids):
        for i in block_ids:
            if self._ref_counts[i] == 0:
                raise ValueError("double free")
            self._ref_counts[i] -= 1


class _NoDoubleFreeCheck(_Ref):  # a double free puts the block on the free list twice
    def free(self, block_ids):
        for i in block_ids:
            self._ref_counts[i] = max(self._ref_counts[i] - 1, 0)
            if self._ref_counts[i] == 0:
                self._free.append(i)


class _PartialAllocate(_Ref):  # hands out what it has, then raises: not all or nothing
    def allocate(self, n=1):
        ids = []
        for _ in range(n):
            if not self._free:
                raise OutOfBlocksError("out")
            ids.append(self._free.popleft())
            self._ref_counts[ids[-1]] = 1
        return ids


@grader_selftest
@pytest.mark.task_04_allocator
@pytest.mark.parametrize("wrong", [_FreeIgnoresRefCount, _LeaksOnFree, _NoDoubleFreeCheck, _PartialAllocate])
def test_allocator_rejects_wrong_answers(wrong):
    with pytest.raises(AssertionError):
        check_allocator(wrong)


# ================================================================================================= task 04.slots


def _slot(table: list[int], p: int, block_size: int) -> int:
    return table[p // block_size] * block_size + p % block_size


def slot_mapping_oracle(tables, context_lens, query_lens, block_size) -> list[int]:
    return [_slot(t, p, block_size) for t, ctx, n in zip(tables, context_lens, query_lens) for p in range(ctx - n, ctx)]


def context_slots_oracle(tables, context_lens, block_size, width) -> tuple[list[list[int]], list[list[bool]]]:
    slots = [[_slot(t, p if p < ctx else 0, block_size) for p in range(width)] for t, ctx in zip(tables, context_lens)]
    return slots, [[p < ctx for p in range(width)] for ctx in context_lens]


def _padded(tables: list[list[int]], dtype=torch.int32) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([list(t) + [-1] * (width - len(t)) for t in tables], dtype=dtype)


def call_slot_mapping(fn, tables, context_lens, query_lens, block_size) -> list[int]:
    args = ([list(t) for t in tables], list(context_lens), list(query_lens), block_size)
    got = fn(*args)
    assert isinstance(got, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in got), (
        f"slot_mapping must return a list of ints, got {type(got).__name__} {got!r:.80}")
    assert args == ([list(t) for t in tables], list(context_lens), list(query_lens), block_size), (
        "slot_mapping changed its arguments")
    return got


def call_context_slots(fn, tables, context_lens, block_size, width, dtype=torch.int32):
    block_tables, lens = _padded(tables, dtype), torch.tensor(context_lens, dtype=dtype)
    before = block_tables.clone(), lens.clone()
    slots, valid = fn(block_tables, lens, block_size, width)
    n = len(tables)
    assert isinstance(slots, torch.Tensor) and slots.shape == (n, width) and slots.dtype == torch.int64, (
        f"slots must be an int64 ({n}, {width}) tensor, got {getattr(slots, 'dtype', type(slots))} "
        f"{tuple(getattr(slots, 'shape', ()))}")
    assert isinstance(valid, torch.Tensor) and valid.shape == (n, width) and valid.dtype == torch.bool, (
        f"valid must be a bool ({n}, {width}) tensor, got {getattr(valid, 'dtype', type(valid))} "
        f"{tuple(getattr(valid, 'shape', ()))}")
    assert torch.equal(block_tables, before[0]) and torch.equal(lens, before[1]), "context_slots changed its inputs"
    return slots.tolist(), valid.tolist()


def check_slot_mapping(fn, tables, context_lens, query_lens, block_size, want=None) -> None:
    want = slot_mapping_oracle(tables, context_lens, query_lens, block_size) if want is None else want
    got = call_slot_mapping(fn, tables, context_lens, query_lens, block_size)
    case = (f"tables {tables}, context_lens {context_lens}, query_lens {query_lens}, block_size {block_size}")
    assert len(got) == len(want), (
        f"{case}: {sum(query_lens)} new tokens need {len(want)} slots, got {len(got)} (only the new tokens, "
        f"positions ctx - n .. ctx - 1 of each sequence, are written)")
    if got != want:
        k = next(k for k, (g, w) in enumerate(zip(got, want)) if g != w)
        seq, first = 0, k
        while first >= query_lens[seq]:
            first, seq = first - query_lens[seq], seq + 1
        p = context_lens[seq] - query_lens[seq] + first
        raise AssertionError(f"{case}: new token {k} is sequence {seq}'s position {p}: slot {want[k]} (block "
                             f"{tables[seq][p // block_size]}, offset {p % block_size}), got {got[k]}")


def check_context_slots(fn, tables, context_lens, block_size, width, want=None, dtype=torch.int32) -> None:
    want_slots, want_valid = context_slots_oracle(tables, context_lens, block_size, width)
    if want is not None:
        assert want == want_slots, "grader bug: hand-computed slots disagree with the oracle"
    got_slots, got_valid = call_context_slots(fn, tables, context_lens, block_size, width, dtype)
    case = f"tables {tables}, context_lens {context_lens}, block_size {block_size}, width {width}"
    for i, ctx in enumerate(context_lens):
        assert got_valid[i] == want_valid[i], (
            f"{case}: sequence {i} holds {ctx} tokens, so valid must be True at positions 0..{ctx - 1} only; got "
            f"{got_valid[i]}")
        for p in range(width):
            if got_slots[i][p] != want_slots[i][p]:
                where = (f"position {p}: slot {want_slots[i][p]}" if p < ctx else
                         f"padding position {p} (past its {ctx} tokens): slot {want_slots[i][p]}, its position 0's "
                         f"(a real key/value the mask drops, never -1 or a -1 table entry)")
                raise AssertionError(f"{case}: sequence {i}, {where}; got {got_slots[i][p]}")


# (tables, context_lens, query_lens, block_size, hand-computed slots)
SLOT_CASES = [
    # two sequences, scattered blocks: a two-token chunk ending a block pair, a whole short prompt
    ([[5, 2], [7]], [6, 3], [2, 3], 4, [8, 9, 28, 29, 30]),
    # a chunk of 6 that starts mid-block (positions 5..10 cross from block 9 into block 1)
    ([[3, 9, 1]], [11], [6], 4, [37, 38, 39, 4, 5, 6]),
    # decode on both sides of a block boundary: position 7 is the last slot of block 9, position 8 the first of 1
    ([[3, 9, 1], [3, 9, 1]], [8, 9], [1, 1], 4, [39, 4]),
    # a whole prompt, a decode and a chunk in one packed step; tables longer than needed (blocks taken ahead)
    ([[0, 6, 4], [2, 8], [1, 3, 5, 9]], [3, 4, 7], [3, 1, 4], 2, [0, 1, 12, 17, 7, 10, 11, 18]),
    # block_size 1: every position its own block
    ([[4, 0, 3, 1]], [4], [2], 1, [3, 1]),
    # sixteen-token blocks (the engine's default), a prompt of 17 and a decode at position 40
    ([[2, 0], [1, 5, 3]], [17, 41], [17, 1], 16, list(range(32, 48)) + [0, 56]),
]

# (tables, context_lens, block_size, width, hand-computed slots)
CONTEXT_CASES = [
    ([[7, 2, 5], [0, -1, -1], [3, 6, -1]], [9, 1, 5], 4, 9,
     [[28, 29, 30, 31, 8, 9, 10, 11, 20], [0] * 9, [12, 13, 14, 15, 24, 12, 12, 12, 12]]),
    ([[7, 2, 5]], [9], 4, 12, [[28, 29, 30, 31, 8, 9, 10, 11, 20, 28, 28, 28]]),  # width past the table's blocks
    ([[1, 4], [6, 9]], [3, 8], 4, 8, [[4, 5, 6, 4, 4, 4, 4, 4], [24, 25, 26, 27, 36, 37, 38, 39]]),
    ([[4, 0, 3]], [3], 1, 5, [[4, 0, 3, 4, 4]]),
]


@pytest.mark.task_04_slots
def test_slot_mapping_crafted():
    forbid_calls(impl.slot_mapping, ["minillm", "AttentionMetadata", "StepPlan"])
    for tables, ctx, qlens, block_size, want in SLOT_CASES:
        assert slot_mapping_oracle(tables, ctx, qlens, block_size) == want, "grader bug: hand-computed slots"
        check_slot_mapping(impl.slot_mapping, tables, ctx, qlens, block_size, want)


@pytest.mark.task_04_slots
def test_context_slots_crafted():
    forbid_calls(impl.context_slots, ["minillm", "AttentionMetadata", "StepPlan"])
    for tables, ctx, block_size, width, want in CONTEXT_CASES:
        real = [[b for b in t if b >= 0] for t in tables]
        for dtype in (torch.int32, torch.int64):  # the engine's tables are int32
            check_context_slots(impl.context_slots, real, ctx, block_size, width, want, dtype)


@st.composite
def step_lists(draw):
    """Scattered block tables (some longer than needed), context lengths and new-token counts for one step."""
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    lens = draw(st.lists(st.integers(1, 40), min_size=1, max_size=5))
    need = [-(-n // block_size) + draw(st.integers(0, 2)) for n in lens]
    ids = draw(st.permutations(range(sum(need) + draw(st.integers(0, 3)))))
    tables, start = [], 0
    for n in need:
        tables.append(list(ids[start:start + n]))
        start += n
    qlens = [draw(st.integers(1, n)) for n in lens]
    return tables, lens, qlens, block_size, max(lens) + draw(st.integers(0, 5))


@pytest.mark.task_04_slots
@settings(max_examples=150, deadline=None)
@given(step_lists())
def test_slots_random(case):
    tables, lens, qlens, block_size, width = case
    check_slot_mapping(impl.slot_mapping, tables, lens, qlens, block_size)
    check_context_slots(impl.context_slots, tables, lens, block_size, width)


def check_write_then_read(slot_mapping, context_slots, seed: int) -> None:
    """The engine's use: sequences grow by chunks and decode steps, blocks taken as they fill, several sequences per
    step. Each step writes its new tokens (ids unique per sequence and position) at slot_mapping's slots, then every
    sequence's context is read back through context_slots: it must be the sequence's tokens in order, padding
    giving its first token."""
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    n_seqs = rng.randint(2, 4)
    targets = [rng.randint(1, 30) for _ in range(n_seqs)]
    num_blocks = sum(-(-t // block_size) for t in targets) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)  # blocks come out of the pool in no particular order
    pool = torch.full((num_blocks * block_size,), -1, dtype=torch.int64)  # -1: a slot nobody wrote
    tables: list[list[int]] = [[] for _ in range(n_seqs)]
    lens = [0] * n_seqs
    token = lambda i, p: 1000 * (i + 1) + p
    while lens != targets:
        seqs = [i for i in range(n_seqs) if lens[i] < targets[i] and rng.random() < 0.7]
        if not seqs:
            continue
        qlens = [1 if lens[i] and rng.random() < 0.5 else rng.randint(1, targets[i] - lens[i]) for i in seqs]
        for i, n in zip(seqs, qlens):
            lens[i] += n
            while len(tables[i]) * block_size < lens[i]:
                tables[i].append(free.pop())
        step_tables, step_lens = [tables[i] for i in seqs], [lens[i] for i in seqs]
        slots = slot_mapping([list(t) for t in step_tables], list(step_lens), list(qlens), block_size)
        new = [token(i, p) for i, n in zip(seqs, qlens) for p in range(lens[i] - n, lens[i])]
        assert len(slots) == len(new), f"a step of {len(new)} new tokens got {len(slots)} slots from slot_mapping"
        assert len(set(slots)) == len(slots), f"two new tokens of one step were given the same slot: {slots}"
        pool[torch.tensor(slots, dtype=torch.int64)] = torch.tensor(new)
        width = max(lens)
        active = [i for i in range(n_seqs) if lens[i]]
        got, valid = context_slots(_padded([tables[i] for i in active]), torch.tensor([lens[i] for i in active],
                                   dtype=torch.int32), block_size, width)
        read = pool[got]
        for row, i in enumerate(active):
            want = [token(i, p) for p in range(lens[i])]
            have = read[row, :lens[i]].tolist()
            assert have == want, (
                f"block_size {block_size}, after a step of new tokens {dict(zip(seqs, qlens))} (sequence: count): "
                f"sequence {i} (table {tables[i]}, {lens[i]} tokens) reads back {have}, a contiguous cache holds "
                f"{want} (-1: a slot nobody wrote; another sequence's id: a slot written twice)")
            assert valid[row].tolist() == [p < lens[i] for p in range(width)], f"sequence {i}: wrong valid mask"
            assert (read[row, lens[i]:] == token(i, 0)).all(), (
                f"sequence {i}: padding positions must read its position 0, got {read[row, lens[i]:].tolist()}")


@pytest.mark.task_04_slots
def test_write_then_read_like_the_engine():
    for seed in range(12):
        check_write_then_read(impl.slot_mapping, impl.context_slots, seed)


# deliberately wrong versions (the committed mutants in tests/graders/mutants.py are more) -----------------------


def wrong_positions_from_zero(block_tables, context_lens, query_lens, block_size):  # a chunk written at 0..n-1
    return [t[p // block_size] * block_size + p % block_size for t, n in zip(block_tables, query_lens)
            for p in range(n)]


def wrong_pads_through_the_table(block_tables, context_lens, block_size, width):  # padding looks up -1 entries
    positions = torch.arange(width)
    valid = positions < context_lens[:, None]
    cols = (positions // block_size).clamp(max=block_tables.shape[1] - 1).expand(len(block_tables), -1)
    return block_tables.long().gather(1, cols) * block_size + positions % block_size, valid


@grader_selftest
@pytest.mark.task_04_slots
def test_slots_rejects_wrong_answers():
    with pytest.raises(AssertionError):
        for tables, ctx, qlens, block_size, want in SLOT_CASES:
            check_slot_mapping(wrong_positions_from_zero, tables, ctx, qlens, block_size, want)
    with pytest.raises(AssertionError):
        for tables, ctx, block_size, width, _ in CONTEXT_CASES:
            check_context_slots(wrong_pads_through_the_table, [[b for b in t if b >= 0] for t in tables], ctx,
                                block_size, width)
    with pytest.raises(AssertionError):
        check_write_then_read(wrong_positions_from_zero, impl.context_slots, 0)


# ========================================================================================= the real model, paged


@pytest.mark.task_04_real_model
def test_your_paged_cache_runs_smollm2(real_model):
    """Your BlockAllocator hands out the blocks of every paged cache, your slot_mapping says where each layer writes
    each new token's key/value (AttentionMetadata.build) and your context_slots where the decode steps and the chunks
    read their context from (StepPlan.build): `minillm.generate(cache="paged")` and the engine (minillm.LLM, 6
    requests on a 6-block pool, with preemptions) give SmolLM2-135M's reference greedy tokens. Stands on exercises
    00, 02 and 03 (norm, RoPE, sampler; the attention: the latest you wrote, else minillm's)."""
    from minillm.course.seams import check_on_ladder
    from tests.graders.real_model import (
        greedy_ids,
        reference_greedy,
        reference_serve,
        same_tokens,
        serve,
        workload,
    )

    model, tok = real_model
    want = reference_greedy(model, tok, cache="paged")
    requests = workload(tok)
    want_served, _ = reference_serve(model, tok, requests)

    def check():
        same_tokens(greedy_ids(model, tok, cache="paged"), want, tok, "generate(cache='paged') with your paged cache")
        got, _ = serve(model, tok, requests)
        for i, (g, w) in enumerate(zip(got, want_served)):
            same_tokens(g, w, tok, f"engine request {i} with your allocator and slots")

    check_on_ladder(model, impl, check)
