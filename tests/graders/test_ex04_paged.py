"""Grader for exercise 04: the block allocator and paged decode attention.

Allocator: seeded random sequences of allocate / fork (incref) / free run against a model of who owns which block;
after every step the ref counts, the free count and the free list must agree with the model. Plus the cases common
wrong answers get wrong: out of blocks (all or nothing, OutOfBlocksError), a shared block freed by one owner (must
stay allocated), double free (ValueError, nothing changed), no leaks.
Attention: SDPA over each sequence's own keys (gathered here, independently) is the oracle; pools hold NaN in every
slot no sequence owns, block ids are shuffled, lengths are not multiples of the block size, GQA maps query head h to
KV head h // group. The `*_rejects_wrong_answers` tests run the same checks on common mistakes (skipped when
grading exercises/).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from minillm.block_allocator import OutOfBlocksError
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


# ======================================================================================= task 04.paged_attention


def _case(lens, n_heads, n_kv_heads, block_size, head_dim, seed):
    """Pools full of NaN except the slots the sequences own (at shuffled block ids); q; each sequence's k/v."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 2
    k_pool = torch.full((num_blocks, block_size, n_kv_heads, head_dim), float("nan"))
    v_pool = k_pool.clone()
    ids = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(lens), max(need) + 1), -1, dtype=torch.int32)  # one extra -1 column for everyone
    seqs = []
    for i, (n, nb) in enumerate(zip(lens, need)):
        mine, ids = ids[:nb], ids[nb:]
        tables[i, :nb] = torch.tensor(mine, dtype=torch.int32)
        k = torch.randn(n, n_kv_heads, head_dim, generator=g)
        v = torch.randn(n, n_kv_heads, head_dim, generator=g)
        for p in range(n):
            k_pool[mine[p // block_size], p % block_size] = k[p]
            v_pool[mine[p // block_size], p % block_size] = v[p]
        seqs.append((k, v))
    q = torch.randn(len(lens), n_heads, head_dim, generator=g)
    return q, k_pool, v_pool, tables, torch.tensor(lens), seqs


def _oracle(q_row, k, v):
    group = q_row.shape[0] // k.shape[1]
    kf = k.transpose(0, 1).repeat_interleave(group, 0)  # (n_heads, n, head_dim): head h reads KV head h // group
    vf = v.transpose(0, 1).repeat_interleave(group, 0)
    return F.scaled_dot_product_attention(q_row[:, None], kf, vf)[:, 0]


CASES = [
    # lens, n_heads, n_kv_heads, block_size, head_dim
    ([1], 2, 1, 4, 8),
    ([5, 16, 17], 4, 2, 16, 8),
    ([3, 9, 1, 30], 6, 2, 4, 16),
    ([33, 7], 9, 3, 8, 16),
    ([12, 12], 4, 4, 4, 8),
    ([40], 8, 1, 16, 32),
]


def check_paged_attention(fn) -> None:
    for seed, (lens, h, hkv, bs, d) in enumerate(CASES):
        q, k_pool, v_pool, tables, ctx, seqs = _case(lens, h, hkv, bs, d, seed)
        out = fn(q, k_pool, v_pool, tables, ctx)
        assert out.shape == q.shape, f"output shape {tuple(out.shape)}, expected {tuple(q.shape)}"
        assert not out.isnan().any(), (
            f"NaN in the output (lens {lens}, block_size {bs}): a position past a sequence's length, or a -1 "
            f"table entry, reached the result; mask the scores and zero the values there")
        for i, (k, v) in enumerate(seqs):
            where = f"sequence {i} (len {lens[i]}, {h} heads / {hkv} KV heads, block {bs})"
            torch.testing.assert_close(out[i], _oracle(q[i], k, v), atol=1e-5, rtol=1e-4,
                                       msg=lambda m, where=where: f"{where}: {m}")
    q, k_pool, v_pool, tables, ctx, seqs = _case([9, 14], 6, 2, 4, 16, 7)  # large logits: scores of hundreds
    q, k_pool = q * 12, k_pool * 12
    out = fn(q, k_pool, v_pool, tables, ctx)
    assert torch.isfinite(out).all(), "scores of a few hundred gave inf/nan: subtract the row max before exp"
    for i, (k, v) in enumerate(seqs):
        torch.testing.assert_close(out[i], _oracle(q[i], k * 12, v), atol=1e-4, rtol=1e-4)
    q, k_pool, v_pool, tables, ctx, seqs = _case([20, 4], 4, 2, 8, 16, 99)
    out = fn(q.bfloat16(), k_pool.bfloat16(), v_pool.bfloat16(), tables, ctx)
    assert out.dtype == torch.bfloat16, "return q's dtype"


@pytest.mark.task_04_paged_attention
def test_paged_attention():
    forbid_calls(impl.paged_attention, ["scaled_dot_product_attention", "minillm", "sdpa_attention",
                                        "naive_attention", "gather_sequence"])
    check_paged_attention(impl.paged_attention)


# deliberately wrong versions ---------------------------------------------------------------------------------------


def _gathered(q, k_pool, v_pool, tables):
    n, d = q.shape[0], q.shape[2]
    hkv = k_pool.shape[2]
    t = tables.long().clamp(min=0)
    keys = k_pool[t].reshape(n, -1, hkv, d).transpose(1, 2)  # (n, hkv, L, d)
    values = v_pool[t].reshape(n, -1, hkv, d).transpose(1, 2)
    return keys, values


def _attend(q, keys, values, valid, head_map, mask_values=True, scale=True):
    d = q.shape[2]
    keys, values = keys[:, head_map], values[:, head_map]  # (n, h, L, d)
    if mask_values:
        values = torch.where(valid[:, None, :, None], values, 0)
    s = (q[:, :, None] @ keys.transpose(-1, -2))[:, :, 0] * (d**-0.5 if scale else 1.0)  # (n, h, L)
    s = s.masked_fill(~valid[:, None], float("-inf"))
    return (s.softmax(-1)[:, :, None] @ values)[:, :, 0]


def _right_map(h, hkv):
    return torch.arange(h) // (h // hkv)


def wrong_reads_whole_blocks(q, k_pool, v_pool, tables, ctx):  # ignores context_lens: the tail of the last block
    keys, values = _gathered(q, k_pool, v_pool, tables)
    valid = (tables >= 0).repeat_interleave(k_pool.shape[1], 1)
    return _attend(q, keys, values, valid, _right_map(q.shape[1], k_pool.shape[2]))


def wrong_masks_scores_only(q, k_pool, v_pool, tables, ctx):  # 0 * NaN from unused value slots leaks
    keys, values = _gathered(q, k_pool, v_pool, tables)
    valid = torch.arange(keys.shape[2]) < ctx[:, None]
    return _attend(q, keys, values, valid, _right_map(q.shape[1], k_pool.shape[2]), mask_values=False)


def wrong_gqa_modulo(q, k_pool, v_pool, tables, ctx):  # query head h -> KV head h % n_kv_heads
    keys, values = _gathered(q, k_pool, v_pool, tables)
    valid = torch.arange(keys.shape[2]) < ctx[:, None]
    return _attend(q, keys, values, valid, torch.arange(q.shape[1]) % k_pool.shape[2])


def wrong_no_scale(q, k_pool, v_pool, tables, ctx):
    keys, values = _gathered(q, k_pool, v_pool, tables)
    valid = torch.arange(keys.shape[2]) < ctx[:, None]
    return _attend(q, keys, values, valid, _right_map(q.shape[1], k_pool.shape[2]), scale=False)


@grader_selftest
@pytest.mark.task_04_paged_attention
@pytest.mark.parametrize("wrong", [wrong_reads_whole_blocks, wrong_masks_scores_only, wrong_gqa_modulo,
                                   wrong_no_scale])
def test_paged_attention_rejects_wrong_answers(wrong):
    with pytest.raises(AssertionError):
        check_paged_attention(wrong)


@grader_selftest
@pytest.mark.task_04_paged_attention
def test_paged_attention_rejects_sdpa():
    def calls_sdpa(q, k_pool, v_pool, tables, ctx):
        return F.scaled_dot_product_attention(q, k_pool, v_pool)

    with pytest.raises(pytest.fail.Exception):
        forbid_calls(calls_sdpa, ["scaled_dot_product_attention", "minillm"])


# ========================================================================================= the real model, paged


@pytest.mark.task_04_real_model
def test_your_paged_cache_runs_smollm2(real_model):
    """Your BlockAllocator hands out the blocks and your paged_attention is the decode backend
    (`register_attention(..., kind="paged_decode")`) of every paged cache: `minillm.generate(cache="paged")` and the
    engine (minillm.LLM, 6 requests on a 6-block pool, with preemptions) give SmolLM2-135M's reference greedy tokens.
    Stands on exercises 00, 02 and 03 (norm, RoPE, sampler; the prefill attention: the latest you wrote, else
    minillm's)."""
    from minillm.checkpoints import check_on_ladder
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
            same_tokens(g, w, tok, f"engine request {i} with your allocator and paged attention")

    check_on_ladder(model, impl, check)
