"""BlockAllocator: unit cases plus a hypothesis state machine that checks the invariants after every step."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minillm.cache.block_allocator import BlockAllocator, BlockTable, OutOfBlocksError, blocks_needed


def test_blocks_needed():
    assert [blocks_needed(n, 4) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert blocks_needed(1, 1) == 1 and blocks_needed(2048, 16) == 128
    with pytest.raises(ValueError):
        blocks_needed(-1, 16)
    with pytest.raises(ValueError):
        blocks_needed(5, 0)


def test_allocate_free_roundtrip():
    a = BlockAllocator(8, 16)
    got = a.allocate(3)
    assert len(set(got)) == 3 and a.num_free() == 5 and all(a.ref_count(b) == 1 for b in got)
    a.free(got)
    assert a.num_free() == 8 and all(a.ref_count(b) == 0 for b in got)
    assert sorted(a.allocate(8)) == list(range(8))


def test_out_of_blocks_is_all_or_nothing_and_says_what_to_do():
    a = BlockAllocator(4, 16)
    a.allocate(3)
    with pytest.raises(OutOfBlocksError, match=r"asked for 2 .* only 1 of 4 are free.*free finished") as e:
        a.allocate(2)
    assert isinstance(e.value, RuntimeError)
    assert a.num_free() == 1 and not a.can_allocate(2) and a.can_allocate(1)


def test_double_free_raises_and_changes_nothing():
    a = BlockAllocator(4, 2)
    x, y = a.allocate(2)
    a.free([x])
    with pytest.raises(ValueError, match="double free"):
        a.free([y, x])  # y is fine, x is not: nothing may change
    assert a.ref_count(y) == 1 and a.num_free() == 3
    with pytest.raises(ValueError, match="double free"):
        a.free([y, y])  # one owner, two frees
    assert a.ref_count(y) == 1


def test_ref_counts_keep_shared_blocks_alive():
    a = BlockAllocator(4, 2)
    (b,) = a.allocate(1)
    a.incref([b])
    assert a.ref_count(b) == 2
    a.free([b])
    assert a.ref_count(b) == 1 and a.num_free() == 3  # still owned by the fork
    a.free([b])
    assert a.num_free() == 4


def test_bad_ids_and_sizes():
    a = BlockAllocator(4, 2)
    for bad in (-1, 4, 1.0, True):
        with pytest.raises(ValueError, match="not a block"):
            a.free([bad])
    with pytest.raises(ValueError, match="is free"):
        a.incref([0])
    with pytest.raises(ValueError):
        a.allocate(-1)
    with pytest.raises(ValueError):
        BlockAllocator(0, 16)
    assert a.allocate(0) == []


def test_block_table_grows_truncates_and_frees():
    a = BlockAllocator(5, 4)
    ids: list[int] = []
    t = BlockTable(a, ids)  # works on the caller's list in place (a Sequence's block_table)
    assert t.missing(0) == 0 and t.missing(5) == 2 and t.can_grow(20) and not t.can_grow(21)
    t.grow(5)
    assert ids == t.block_ids and len(t) == 2 and a.num_free() == 3
    t.grow(8)  # still two blocks
    assert len(t) == 2 and t.missing(8) == 0
    with pytest.raises(OutOfBlocksError):
        t.grow(24)  # 4 more blocks, 3 free: takes none
    assert len(t) == 2 and a.num_free() == 3
    t.grow(9)
    head = list(ids)
    t.truncate(4)  # positions 0..3: the first block stays
    assert ids == head[:1] and a.num_free() == 4
    t.truncate(4)
    assert ids == head[:1]
    t.grow(12)
    t.free()
    assert ids == [] and a.num_free() == 5
    t.free()  # nothing held: nothing to do
    assert a.num_free() == 5


def test_block_table_frees_tail_first():
    a = BlockAllocator(4, 2)
    t = BlockTable(a)
    t.grow(6)
    blocks = list(t.block_ids)
    a.allocate(1)
    t.free()
    assert a.allocate(3) == blocks[::-1]  # the free list now hands them out tail first


class AllocatorMachine(RuleBasedStateMachine):
    """Sequences own lists of blocks; a model of who owns what is checked against the allocator after every rule."""

    def __init__(self):
        super().__init__()
        self.alloc = BlockAllocator(12, 4)
        self.owners: list[list[int]] = []  # one entry per live owner (a sequence or a fork)

    def expected_refs(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        for blocks in self.owners:
            for b in blocks:
                refs[b] = refs.get(b, 0) + 1
        return refs

    @rule(n=st.integers(0, 6))
    def allocate(self, n):
        free_before = self.alloc.num_free()
        if n > free_before:
            with pytest.raises(OutOfBlocksError):
                self.alloc.allocate(n)
            assert self.alloc.num_free() == free_before  # all or nothing
            return
        got = self.alloc.allocate(n)
        in_use = set(self.expected_refs())
        assert len(set(got)) == n and not in_use & set(got), "a block was handed out twice"
        self.owners.append(got)

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def free(self, data):
        blocks = self.owners.pop(data.draw(st.integers(0, len(self.owners) - 1)))
        self.alloc.free(blocks)

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def fork(self, data):
        blocks = self.owners[data.draw(st.integers(0, len(self.owners) - 1))]
        self.alloc.incref(blocks)
        self.owners.append(list(blocks))

    @rule(b=st.integers(0, 11))
    def double_free_is_caught(self, b):
        if self.expected_refs().get(b, 0) == 0:
            with pytest.raises(ValueError):
                self.alloc.free([b])

    @invariant()
    def counts_match_owners(self):
        refs = self.expected_refs()
        for b in range(self.alloc.num_blocks):
            assert self.alloc.ref_count(b) == refs.get(b, 0)
        assert self.alloc.num_free() == self.alloc.num_blocks - len(refs)
        free = list(self.alloc._free)
        assert len(free) == len(set(free)) and not set(free) & set(refs), "free list holds a block twice or in use"

    def teardown(self):
        for blocks in self.owners:
            self.alloc.free(blocks)
        assert self.alloc.num_free() == self.alloc.num_blocks, "blocks leaked"


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
