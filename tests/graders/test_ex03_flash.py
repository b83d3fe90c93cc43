"""Grader for exercise 03: merge two softmax partials, tiled flash attention in torch, and (optional) the Triton
kernel's inner online-softmax step.

Oracles: a full softmax over the union of keys (merge), torch's F.scaled_dot_product_attention with an explicit
bottom-right mask and its GQA mode (flash, Triton), a float64 log-sum-exp of the masked scores (return_lse). Beyond
the values, flash_attention must never create a tensor as big as one head's q_len x kv_len score matrix (a
TorchFunctionMode records every op's output), must never copy K/V per query head (`_KVCopies` follows K and V through
every torch call), must skip the key blocks above the causal diagonal (torch's FlopCounterMode: causal runs must do
clearly fewer matmul FLOPs) and must refuse block sizes < 1. The `*_rejects_wrong_answers` tests run the same checks
on common mistakes (skipped when grading exercises/).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from tests.graders.conftest import TARGET, forbid_calls, load_impl

impl = load_impl("ex03_flash")
grader_selftest = pytest.mark.skipif(TARGET == "exercises", reason="checks the grader itself, not your code")


def _qkv(batch, n_heads, n_kv_heads, q_len, kv_len, head_dim, seed=0, scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n_heads, q_len, head_dim, generator=g) * scale
    k = torch.randn(batch, n_kv_heads, kv_len, head_dim, generator=g) * scale
    v = torch.randn(batch, n_kv_heads, kv_len, head_dim, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _mask(q_len, kv_len):
    """Bool (q_len, kv_len): query i sees key j <= i + kv_len - q_len (bottom-right aligned)."""
    return torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=kv_len - q_len)


def oracle(q, k, v, causal):
    """torch SDPA in float32 with its GQA mode (query head h reads KV head h // group), bottom-right causal mask
    built here."""
    mask = _mask(q.shape[2], k.shape[2]) if causal else None
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                          enable_gqa=q.shape[1] != k.shape[1])


def lse_oracle(q, k, causal):
    """Each query row's log-sum-exp of its scaled, masked scores, in float64: (batch, n_heads, q_len)."""
    b, n_heads, q_len, d = q.shape
    n_kv_heads, kv_len = k.shape[1], k.shape[2]
    qg = q.double().reshape(b, n_kv_heads, n_heads // n_kv_heads, q_len, d)  # head h = kv * group + g
    s = torch.einsum("bkgqd,bknd->bkgqn", qg, k.double()) * d**-0.5
    if causal:
        s = s.masked_fill(~_mask(q_len, kv_len), float("-inf"))
    return torch.logsumexp(s, dim=-1).reshape(b, n_heads, q_len)


# ================================================================================================= task 03.merge


def _partial(s, v):
    """(o, m, l) of score rows s (..., n) over values v (n, d); n may be 0 (the empty partial)."""
    if s.shape[-1] == 0:
        return (torch.zeros(*s.shape[:-1], v.shape[-1]), torch.full(s.shape[:-1], float("-inf")),
                torch.zeros(s.shape[:-1]))
    m = s.amax(-1)
    p = torch.exp(s - m[..., None])
    return p @ v, m, p.sum(-1)


def check_merge(merge) -> None:
    g = torch.Generator().manual_seed(3)
    for n1, n2, spread in [(5, 7, 1.0), (1, 30, 10.0), (30, 1, 10.0), (0, 9, 3.0), (9, 0, 3.0), (16, 16, 30.0)]:
        s = torch.randn(4, 3, n1 + n2, generator=g) * spread  # (batch, rows, keys): large spread -> exp overflow
        s[..., n1:] += 5.0  # the second half holds the larger scores: the first partial must be rescaled down
        v = torch.randn(n1 + n2, 8, generator=g)
        o, m, l = merge(*_partial(s[..., :n1], v[:n1]), *_partial(s[..., n1:], v[n1:]))
        assert o.shape == (4, 3, 8) and m.shape == (4, 3) and l.shape == (4, 3), "keep the shapes of the inputs"
        torch.testing.assert_close(m, s.amax(-1), msg="m must be the maximum score over both key sets")
        torch.testing.assert_close(l, torch.exp(s - s.amax(-1, keepdim=True)).sum(-1), atol=1e-5, rtol=1e-5,
                                   msg="l must be sum(exp(s - m)) over both key sets, relative to the new max")
        torch.testing.assert_close(o / l[..., None], s.softmax(-1) @ v, atol=1e-5, rtol=1e-5,
                                   msg="o / l must equal the full softmax(s) @ v")
    # two empty partials merge into an empty one, not into nan
    empty = _partial(torch.zeros(2, 0), torch.zeros(0, 4))
    o, m, l = merge(*empty, *empty)
    assert not torch.isnan(o).any() and not torch.isnan(l).any(), "merging two empty partials produced nan"
    assert torch.equal(l, torch.zeros(2)) and torch.equal(o, torch.zeros(2, 4)), "empty + empty must stay empty"


@pytest.mark.task_03_merge
def test_merge_partials_equals_full_softmax():
    check_merge(impl.merge_partials)
    forbid_calls(impl.merge_partials, ["softmax", "logsumexp", "scaled_dot_product_attention", "minillm"])


def _merge_without_rescale(o1, m1, l1, o2, m2, l2):
    return o1 + o2, torch.maximum(m1, m2), l1 + l2


def _merge_without_empty_guard(o1, m1, l1, o2, m2, l2):
    m = torch.maximum(m1, m2)
    a1, a2 = torch.exp(m1 - m), torch.exp(m2 - m)
    return a1[..., None] * o1 + a2[..., None] * o2, m, a1 * l1 + a2 * l2


def _merge_rescale_inverted(o1, m1, l1, o2, m2, l2):
    m = torch.maximum(m1, m2)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    a1, a2 = torch.exp(m_safe - m1).nan_to_num(0.0, 0.0), torch.exp(m_safe - m2).nan_to_num(0.0, 0.0)
    return a1[..., None] * o1 + a2[..., None] * o2, m, a1 * l1 + a2 * l2


@grader_selftest
@pytest.mark.parametrize("wrong", [_merge_without_rescale, _merge_without_empty_guard, _merge_rescale_inverted])
def test_merge_grader_rejects_wrong_answers(wrong):
    with pytest.raises(AssertionError):
        check_merge(wrong)


# ================================================================================================= task 03.flash


class _LargestTensor(TorchFunctionMode):
    """Records the largest tensor any torch op returns while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


# calls that combine K/V with something else into new values (scores, outputs): what they return is not K/V data
_COMBINE = {"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm", "addmm", "addbmm", "einsum", "tensordot",
            "mv", "dot", "inner", "linear"}


def _elements_read(tensors) -> int:
    """How many distinct storage elements the tensors address together (an expanded view counts its source once)."""
    by_storage: dict[int, list] = {}
    for t in tensors:
        if t.numel() == 0:
            continue
        storage = t.untyped_storage()
        offsets = torch.arange(storage.nbytes() // t.element_size()).as_strided(t.shape, t.stride(),
                                                                                t.storage_offset())
        by_storage.setdefault(storage.data_ptr(), []).append(offsets.reshape(-1))
    return sum(int(torch.cat(o).unique().numel()) for o in by_storage.values())


class _KVCopies(TorchFunctionMode):
    """Follows K and V through every torch call made while active (any name or alias: it sees the calls, not the
    source). A call that takes K/V data and is not a product with other operands (_COMBINE) returns K/V data again.
    Where that result lives in new memory, it is a copy: `copied` adds up its elements (and those written into
    another tensor in place), and `replicated` records a copy holding more elements than all of its inputs address,
    which is what repeat_interleave, repeat, expand(...).reshape, cat/stack of one tensor or an index with repeats
    build when K/V are copied once per query head. Broadcasting K/V inside a product (q_grouped @ k_tile) is reading
    them in place and is not counted."""

    def __init__(self, *sources: torch.Tensor):
        super().__init__()
        self.keep = list(sources)  # holding them keeps their ids unique while the mode is active
        self.ids = {id(t) for t in sources}
        self.copied = 0
        self.replicated: list[str] = []

    def _derive(self, t: torch.Tensor) -> None:
        self.keep.append(t)
        self.ids.add(id(t))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        kv = [t for t in inputs if id(t) in self.ids]
        if not kv or name in _COMBINE:
            return out
        if name == "__setitem__" or (name.endswith("_") and not name.startswith("_")):  # written into args[0]
            sources = [t for t in kv if t is not args[0]]
            if sources:  # K/V data written into a tensor (a scale applied in place to K/V data itself is no copy)
                self.copied += args[0][args[1]].numel() if name == "__setitem__" else max(t.numel() for t in sources)
                self._derive(args[0])
            return out
        own = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
        others = sum(t.numel() for t in inputs if id(t) not in self.ids)
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            self._derive(t)
            if t.numel() and t.untyped_storage().data_ptr() not in own:  # new memory: a copy of K/V data
                self.copied += t.numel()
                read = _elements_read(kv)
                if t.numel() > read + others:
                    self.replicated.append(f"{name} built a {tuple(t.shape)} tensor ({t.numel()} elements) from "
                                           f"{read} elements of K/V")
        return out


def check_kv_in_place(fn) -> None:
    """GQA reads each KV head in place: no call may replicate K/V (prefill, several query tiles), and a decode step
    (one query tile: each key read once) may copy at most 2x the K/V it was given (e.g. a contiguous or float copy)
    while 8 query heads share one KV head (a copy per query head is 8x)."""
    for case, causal in (((1, 8, 2, 96, 96, 16, 32, 32), True), ((2, 8, 1, 1, 128, 16, 16, 32), False)):
        *shape, block_q, block_k = case
        q, k, v = _qkv(*shape, seed=5)
        with _KVCopies(k, v) as kv:
            out = fn(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
        torch.testing.assert_close(out, oracle(q, k, v, causal), atol=1e-5, rtol=1e-5)
        assert not kv.replicated, (
            f"K/V were copied per query head ({shape[1]} query heads over {shape[2]} KV heads, case {case}): "
            f"{kv.replicated[0]}. A query head reads its group's K/V in place: group the query heads per KV head "
            f"(q viewed as (batch, n_kv_heads, group, q_len, head_dim)) and let the products broadcast K/V")
        limit = 2 * (k.numel() + v.numel())
        assert kv.copied <= limit, (
            f"one decode step (case {case}, {shape[1]} query heads over {shape[2]} KV head) copied {kv.copied} "
            f"elements of K/V, more than twice the {k.numel() + v.numel()} it was given: K/V copied per query head "
            f"(a loop over heads, or per-head tiles). A query head reads its group's K/V in place")


LSE_CASES = [  # ((batch, n_heads, n_kv_heads, q_len, kv_len, head_dim), block_q, block_k, causal, scale, dtype)
    ((2, 4, 2, 50, 50, 16), 16, 16, True, 1.5, torch.float32),
    ((1, 6, 2, 1, 100, 16), 32, 32, True, 1.5, torch.float32),  # decode
    ((1, 6, 3, 37, 100, 16), 16, 32, True, 1.5, torch.float32),  # chunked prefill
    ((1, 4, 4, 129, 129, 8), 32, 64, False, 1.5, torch.float32),
    ((1, 2, 1, 40, 90, 16), 16, 16, True, 12.0, torch.float32),  # scores in the hundreds: exp(s) overflows float32
    ((1, 2, 1, 0, 20, 16), 16, 16, True, 1.0, torch.float32),  # no queries: empty results of the right shapes
    ((1, 2, 1, 40, 60, 16), 16, 16, True, 1.5, torch.bfloat16),
    ((1, 1, 1, 20, 20, 16), 8, 8, True, None, torch.float32),  # None: every score about -400 (see check_flash)
    ((1, 1, 1, 20, 20, 16), 8, 8, False, None, torch.float32),
]


def check_lse(fn) -> None:
    """return_lse=True: (the same output, each row's log-sum-exp of its scaled visible scores, float32), against a
    float64 logsumexp."""
    for shape, block_q, block_k, causal, scale, dtype in LSE_CASES:
        q, k, v = _qkv(*shape, seed=sum(shape), scale=scale or 1.0, dtype=dtype)
        if scale is None:
            q, k = q.abs() + 4, -(k.abs() + 4)
        where = f"(shape {shape}, causal={causal}, {dtype}, blocks {block_q} x {block_k}" + (
            ", every score about -400)" if scale is None else ")")
        got = fn(q, k, v, causal=causal, block_q=block_q, block_k=block_k, return_lse=True)
        assert isinstance(got, tuple) and len(got) == 2, f"return_lse=True must return (out, lse) {where}"
        out, lse = got
        plain = fn(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
        torch.testing.assert_close(out, plain, atol=1e-6, rtol=1e-6,
                                   msg=lambda m, w=where: f"out with return_lse differs from out without {w}")
        want_shape = (shape[0], shape[1], shape[3])
        assert lse.dtype == torch.float32 and tuple(lse.shape) == want_shape, (
            f"lse must be float32 (batch, n_heads, q_len) = {want_shape}, got {lse.dtype} {tuple(lse.shape)} {where}")
        want = lse_oracle(q, k, causal)
        torch.testing.assert_close(lse.double(), want, atol=1e-5, rtol=1e-5, msg=lambda m, w=where: (
            f"{m}\nlse must be log(sum_j exp(s_j)) over each row's visible scaled scores s = q.k / sqrt(head_dim), "
            f"i.e. the final running max plus log(running sum) {w}"))


def check_block_sizes(fn) -> None:
    """Block sizes < 1 are a ValueError (each of block_q and block_k); 1 and sizes beyond the lengths are valid."""
    q, k, v = _qkv(1, 2, 1, 5, 9, 8, seed=4)
    for block_q, block_k in ((0, 16), (16, 0), (-1, 16), (16, -1), (-16, -16), (0, 0)):
        try:
            fn(q, k, v, causal=True, block_q=block_q, block_k=block_k)
        except ValueError:
            continue
        raise AssertionError(f"block_q={block_q}, block_k={block_k} gave a result: block sizes < 1 must raise "
                             f"ValueError (a negative step makes range() skip the loop without a word)")
    for block_q, block_k in ((1, 1), (1, 4), (64, 1), (1000, 1000)):
        torch.testing.assert_close(fn(q, k, v, causal=True, block_q=block_q, block_k=block_k),
                                   oracle(q, k, v, True), atol=1e-5, rtol=1e-5,
                                   msg=lambda m, bq=block_q, bk=block_k: f"{m}\n(block_q={bq}, block_k={bk})")


CASES = [  # (batch, n_heads, n_kv_heads, q_len, kv_len, head_dim, block_q, block_k)
    (1, 1, 1, 1, 1, 8, 16, 16),
    (2, 4, 2, 50, 50, 16, 16, 16),  # not a multiple of the block
    (1, 6, 2, 1, 100, 16, 32, 32),  # decode: one query over a longer cache
    (1, 6, 3, 37, 100, 16, 16, 32),  # chunked prefill: the queries are the last 37 positions
    (2, 2, 1, 70, 70, 32, 64, 16),
    (1, 4, 4, 129, 129, 8, 32, 64),
]


def check_flash(fn) -> None:
    for case in CASES:
        *shape, block_q, block_k = case
        for causal in (True, False):
            q, k, v = _qkv(*shape, seed=sum(case), scale=1.5)
            out = fn(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
            assert out.shape == q.shape, f"output shape {tuple(out.shape)} != q's {tuple(q.shape)}"
            torch.testing.assert_close(out, oracle(q, k, v, causal), atol=1e-5, rtol=1e-5,
                                       msg=lambda m, c=case, cz=causal: f"{m}\n(case {c}, causal={cz})")
    # every score of every row very negative (about -400): a running max started at 0 instead of -inf makes
    # exp(s - 0) underflow to 0 for the whole row, and the output 0/0 = nan
    q, k, v = _qkv(1, 1, 1, 20, 20, 16, seed=3)
    q, k = q.abs() + 4, -(k.abs() + 4)
    for causal in (True, False):
        out = fn(q, k, v, causal=causal, block_q=8, block_k=8)
        assert torch.isfinite(out).all(), ("rows whose scores are all very negative gave nan: start the running "
                                           "max at -inf, not 0")
        torch.testing.assert_close(out, oracle(q, k, v, causal), atol=1e-4, rtol=1e-4)
    # low precision in, same dtype out, float32 accumulation
    q, k, v = _qkv(1, 2, 1, 40, 60, 16, dtype=torch.bfloat16)
    out = fn(q, k, v, causal=True, block_q=16, block_k=16)
    assert out.dtype == torch.bfloat16, f"output dtype must be the input's (bfloat16), got {out.dtype}"
    torch.testing.assert_close(out.float(), oracle(q, k, v, True), atol=2e-2, rtol=2e-2)
    # only tiles: no temporary bigger than q itself or a few block_q x block_k score tiles per head
    q, k, v = _qkv(1, 2, 1, 256, 256, 16)
    with _LargestTensor() as work:
        fn(q, k, v, causal=True, block_q=32, block_k=32)
    limit = max(q.numel(), 4 * 2 * 32 * 32)
    assert work.largest <= limit, (
        f"a tensor of {work.largest} elements was created (limit {limit}): scores of whole rows (here 2 heads x "
        f"256 x 256) must never exist; work on block_q x block_k tiles")
    # causal attention skips key blocks above the diagonal: 36 of 64 tiles here, so clearly fewer matmul FLOPs
    q, k, v = _qkv(1, 1, 1, 512, 512, 16)
    flops = {}
    for causal in (True, False):
        with FlopCounterMode(display=False) as counter:
            fn(q, k, v, causal=causal, block_q=64, block_k=64)
        flops[causal] = counter.get_total_flops()
    assert flops[True] < 0.75 * flops[False], (
        f"causal attention did {flops[True] / max(flops[False], 1):.2f}x the matmul FLOPs of non-causal: skip key "
        f"blocks that lie entirely above the diagonal instead of computing and masking them")


@pytest.mark.task_03_flash
def test_flash_attention_matches_sdpa():
    check_flash(impl.flash_attention)
    forbid_calls(impl.flash_attention, ["scaled_dot_product_attention", "softmax", "naive_attention",
                                        "sdpa_attention", "get_attention", "minillm"])


@pytest.mark.task_03_flash
def test_flash_attention_reads_kv_in_place():
    check_kv_in_place(impl.flash_attention)


@pytest.mark.task_03_flash
def test_flash_attention_log_sum_exp():
    check_lse(impl.flash_attention)


@pytest.mark.task_03_flash
def test_flash_attention_rejects_bad_block_sizes():
    check_block_sizes(impl.flash_attention)


@pytest.mark.task_03_flash
@settings(max_examples=25, deadline=None)
@given(st.integers(1, 2), st.sampled_from([(1, 1), (2, 1), (4, 2), (6, 3), (6, 6)]), st.integers(1, 90),
       st.integers(0, 60), st.sampled_from([16, 32]), st.booleans(), st.integers(0, 1000))
def test_flash_attention_random_shapes(batch, heads, q_len, extra, block, causal, seed):
    q, k, v = _qkv(batch, *heads, q_len, q_len + extra, 16, seed=seed)
    out = impl.flash_attention(q, k, v, causal=causal, block_q=block, block_k=block)
    torch.testing.assert_close(out, oracle(q, k, v, causal), atol=1e-5, rtol=1e-5)


def _tiled(q, k, v, causal=True, block_q=64, block_k=64, return_lse=False, *, rescale=True, offset_aware=True,
           skip=True):
    """A compact flash attention with switches for common mistakes (the right one has every switch on)."""
    if block_q < 1 or block_k < 1:
        raise ValueError("block sizes must be >= 1")
    b, h, q_len, d = q.shape
    h_kv, kv_len = k.shape[1], k.shape[2]
    qg = q.reshape(b, h_kv, h // h_kv, q_len, d)  # head h = kv * group + g: K/V broadcast over g, never copied
    offset = kv_len - q_len if offset_aware else 0
    out, lse = torch.empty(qg.shape), torch.empty(qg.shape[:-1])
    for qs in range(0, q_len, block_q):
        qt = qg[:, :, :, qs:qs + block_q].float() * d**-0.5
        m = torch.full(qt.shape[:-1], float("-inf"))
        l, acc = torch.zeros(qt.shape[:-1]), torch.zeros(qt.shape)
        stop = min(kv_len, qs + qt.shape[3] + offset) if causal and skip else kv_len
        for ks in range(0, stop, block_k):
            s = qt @ k[:, :, None, ks:ks + block_k].float().transpose(-1, -2)
            if causal:
                qpos = torch.arange(qs, qs + qt.shape[3])[:, None] + offset
                s = s.masked_fill(torch.arange(ks, ks + s.shape[-1])[None, :] > qpos, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            a = torch.exp(m - m_new) if rescale else torch.ones_like(m)
            l, acc, m = a * l + p.sum(-1), a[..., None] * acc + p @ v[:, :, None, ks:ks + block_k].float(), m_new
        out[:, :, :, qs:qs + block_q] = acc / l[..., None]
        lse[..., qs:qs + block_q] = m + torch.log(l)
    out = out.reshape(q.shape).to(q.dtype)
    return (out, lse.reshape(b, h, q_len)) if return_lse else out


def _flash_no_rescale(q, k, v, causal=True, block_q=64, block_k=64):
    return _tiled(q, k, v, causal, block_q, block_k, rescale=False)


def _flash_top_left_mask(q, k, v, causal=True, block_q=64, block_k=64):
    return _tiled(q, k, v, causal, block_q, block_k, offset_aware=False)


def _flash_no_block_skipping(q, k, v, causal=True, block_q=64, block_k=64):
    return _tiled(q, k, v, causal, block_q, block_k, skip=False)


def _flash_whole_rows(q, k, v, causal=True, block_q=64, block_k=64):
    """Tiles the queries but takes every key at once: the full score rows exist."""
    return _tiled(q, k, v, causal, block_q, block_k=max(k.shape[2], 1))


def _flash_repeats_kv(q, k, v, causal=True, block_q=64, block_k=64, return_lse=False):
    """Right values, but K/V repeated once per query head before the loop (what SDPA's oracle used to do)."""
    group = q.shape[1] // k.shape[1]
    return _tiled(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), causal, block_q, block_k,
                  return_lse)


def _flash_expands_kv(q, k, v, causal=True, block_q=64, block_k=64, return_lse=False):
    """The same copy written as expand + reshape."""
    b, h_kv, n, d = k.shape
    group = q.shape[1] // h_kv
    k2, v2 = (t[:, :, None].expand(b, h_kv, group, n, d).reshape(b, h_kv * group, n, d) for t in (k, v))
    return _tiled(q, k2, v2, causal, block_q, block_k, return_lse)


def _flash_copies_kv_per_head(q, k, v, causal=True, block_q=64, block_k=64, return_lse=False):
    """The same copy, one query head at a time into a preallocated buffer."""
    group = q.shape[1] // k.shape[1]
    k2, v2 = q.new_empty(q.shape[:2] + k.shape[2:]), q.new_empty(q.shape[:2] + k.shape[2:])
    for head in range(q.shape[1]):
        k2[:, head], v2[:, head] = k[:, head // group], v[:, head // group]
    return _tiled(q, k2, v2, causal, block_q, block_k, return_lse)


def _flash_lse_without_max(q, k, v, causal=True, block_q=64, block_k=64, return_lse=False):
    """log(l) alone: l is relative to the running max, so the max must be added back."""
    out, lse = _tiled(q, k, v, causal, block_q, block_k, return_lse=True)
    return (out, lse - _row_max(q, k, causal)) if return_lse else out


def _scores(q, k, causal):
    """(batch, n_heads, q_len, kv_len) float32 scaled scores, -inf where masked (for the wrong answers below)."""
    b, h, q_len, d = q.shape
    s = q.float().reshape(b, k.shape[1], h // k.shape[1], q_len, d) @ k.float()[:, :, None].transpose(-1, -2)
    s = s.reshape(b, h, q_len, k.shape[2]) * d**-0.5
    return s.masked_fill(~_mask(q_len, k.shape[2]), float("-inf")) if causal else s


def _row_max(q, k, causal):
    s = _scores(q, k, causal)
    return s.amax(-1) if s.shape[2] else s.sum(-1)


def _flash_lse_natural_sum(q, k, v, causal=True, block_q=64, block_k=64, return_lse=False):
    """log(sum exp(s)) straight from the scores: exp overflows when the scores reach ~89."""
    out = _tiled(q, k, v, causal, block_q, block_k)
    if not return_lse:
        return out
    return out, torch.log(torch.exp(_scores(q, k, causal)).sum(-1))


def _flash_checks_block_q_only(q, k, v, causal=True, block_q=64, block_k=64, return_lse=False):
    if block_q < 1:
        raise ValueError("block_q must be >= 1")
    return _tiled(q, k, v, causal, block_q, max(block_k, 1), return_lse)


@grader_selftest
def test_flash_grader_accepts_the_compact_right_answer():
    check_flash(_tiled)  # so the switches below are what gets caught


@grader_selftest
@pytest.mark.parametrize("wrong", [_flash_no_rescale, _flash_top_left_mask, _flash_no_block_skipping,
                                   _flash_whole_rows])
def test_flash_grader_rejects_wrong_answers(wrong):
    with pytest.raises(AssertionError):
        check_flash(wrong)


@grader_selftest
@pytest.mark.parametrize("check, wrong", [
    (check_kv_in_place, _flash_repeats_kv), (check_kv_in_place, _flash_expands_kv),
    (check_kv_in_place, _flash_copies_kv_per_head), (check_lse, _flash_lse_without_max),
    (check_lse, _flash_lse_natural_sum), (check_block_sizes, _flash_checks_block_q_only)])
def test_flash_contract_checks_reject_wrong_answers(check, wrong):
    check(_tiled)  # the compact right answer passes, so the switch in `wrong` is what gets caught
    with pytest.raises(AssertionError):
        check(wrong)


@grader_selftest
def test_flash_grader_rejects_calling_sdpa():
    def flash_attention(q, k, v, causal=True, block_q=64, block_k=64):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    with pytest.raises(pytest.fail.Exception):
        forbid_calls(flash_attention, ["scaled_dot_product_attention", "softmax"])


# ================================================================================================= task 03.triton

try:
    import minillm_kernels.flash_attn as fa
    from minillm_kernels._triton_env import tl, triton
    from triton.runtime.jit import KernelInterface
except ImportError:  # triton not installed
    fa = None

needs_triton = pytest.mark.skipif(fa is None, reason="triton is not installed (pip install -e '.[kernels]'): "
                                                      "task 03.triton is optional")
TRITON_CASES = [  # (batch, n_heads, n_kv_heads, q_len, kv_len, head_dim, causal)
    (1, 2, 1, 50, 50, 16, True),  # ragged end, diagonal tiles
    (1, 2, 2, 100, 100, 32, True),  # more than one key tile per query tile
    (1, 4, 2, 1, 90, 16, True),  # decode
    (1, 2, 1, 20, 90, 16, True),  # chunked prefill: bottom-right alignment
    (1, 2, 1, 40, 100, 32, False),
]


def _kernel_with(block_fn):
    """The engine's flash kernel, but calling `block_fn` where it calls attend_key_block."""
    base = fa._flash_fwd_kernel.fn
    env = dict(base.__globals__, attend_key_block=block_fn)
    return triton.jit(types.FunctionType(base.__code__, env, base.__name__, base.__defaults__, base.__closure__))


def check_triton_block(block_fn) -> None:
    if not isinstance(block_fn, KernelInterface):
        # a stub raises its NotImplementedError here; anything else forgot the decorator
        block_fn(*([None] * 14), MASKED=False, CAUSAL=False, UPCAST=False)
        pytest.fail("attend_key_block must be a @triton.jit function")
    kernel = _kernel_with(block_fn)
    for *shape, causal in TRITON_CASES:
        q, k, v = _qkv(*shape, seed=sum(shape))
        out = fa.launch_fixed(kernel, q, k, v, causal, block_m=16 if shape[3] < 32 else 32, block_n=32)
        torch.testing.assert_close(out, oracle(q, k, v, causal), atol=1e-4, rtol=1e-4,
                                   msg=lambda m, s=shape, c=causal: f"{m}\n(shape {s}, causal={c})")


@pytest.mark.task_03_triton
@needs_triton
def test_triton_attend_key_block_in_the_kernel():
    check_triton_block(impl.attend_key_block)


if fa is not None:

    @triton.jit
    def _block_no_rescale(acc, m_i, l_i, q, k_ptrs, v_ptrs, start_n, offs_m, offs_n, kv_len, causal_offset,
                          qk_scale, stride_kn, stride_vn, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                          UPCAST: tl.constexpr):
        offs_k = start_n + offs_n
        in_bounds = offs_k < kv_len
        k = tl.load(k_ptrs + start_n * stride_kn, mask=in_bounds[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptrs + start_n * stride_vn, mask=in_bounds[:, None], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        visible = in_bounds[None, :]
        if CAUSAL:
            visible = visible & (offs_k[None, :] <= offs_m[:, None] + causal_offset)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i + tl.sum(p, 1)  # forgets to rescale l and acc by exp2(m_i - m_new)
        acc = tl.dot(p, v, acc, input_precision="ieee")
        return acc, m_new, l_i

    @triton.jit
    def _block_strict_causal(acc, m_i, l_i, q, k_ptrs, v_ptrs, start_n, offs_m, offs_n, kv_len, causal_offset,
                             qk_scale, stride_kn, stride_vn, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                             UPCAST: tl.constexpr):
        offs_k = start_n + offs_n
        in_bounds = offs_k < kv_len
        k = tl.load(k_ptrs + start_n * stride_kn, mask=in_bounds[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptrs + start_n * stride_vn, mask=in_bounds[:, None], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        visible = in_bounds[None, :]
        if CAUSAL:
            visible = visible & (offs_k[None, :] < offs_m[:, None] + causal_offset)  # off by one: hides the diagonal
        s = tl.where(visible, s, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        rescale = tl.exp2(m_i - m_new)
        l_i = l_i * rescale + tl.sum(p, 1)
        acc = tl.dot(p, v, acc * rescale[:, None], input_precision="ieee")
        return acc, m_new, l_i


@grader_selftest
@needs_triton
@pytest.mark.parametrize("wrong", ["_block_no_rescale", "_block_strict_causal"])
def test_triton_grader_rejects_wrong_answers(wrong):
    with pytest.raises(AssertionError):
        check_triton_block(globals()[wrong])


@grader_selftest
@needs_triton
def test_triton_grader_rejects_a_plain_python_function():
    def attend_key_block(*args, **kwargs):
        return args[:3]

    with pytest.raises(pytest.fail.Exception, match="triton.jit"):
        check_triton_block(attend_key_block)


# ======================================================================================= speed: the tile loop

SPEED_SHAPE = (1, 9, 3, 512, 512, 64)  # SmolLM2's attention: 9 query heads over 3 KV heads of 64 dims, 512 tokens
SPEED_TOLERANCE = 4.0  # the same algorithm lands at 1-2x, a loop per row at ~35x; per head ~7x, too noisy to grade


def check_flash_speed(fn) -> None:
    """fn's 512-token causal prefill (64 x 64 tiles) against minillm's tile loop, timed in interleaved pairs (a
    noisy machine slows both halves of a pair): the median ratio must be within SPEED_TOLERANCE, and the timed
    output right (a fast wrong answer does not pass)."""
    from minillm.attention.flash import flash_attention as reference
    from minillm.measure.harness import paired_ratio

    q, k, v = _qkv(*SPEED_SHAPE, seed=11)
    torch.testing.assert_close(fn(q, k, v, causal=True, block_q=64, block_k=64), oracle(q, k, v, True),
                               atol=1e-5, rtol=1e-5)
    ratio = paired_ratio(lambda: fn(q, k, v, causal=True, block_q=64, block_k=64),
                         lambda: reference(q, k, v, causal=True, block_q=64, block_k=64), pairs=9)
    assert ratio.median <= SPEED_TOLERANCE, (
        f"your flash_attention took {ratio} the time of minillm's on a {SPEED_SHAPE[3]}-token prefill with "
        f"{SPEED_SHAPE[1]} heads, 64 x 64 tiles (allowed: {SPEED_TOLERANCE}x). Each torch call costs microseconds "
        f"of Python and dispatch whatever its size: loop over query and key tiles only, and let each tile's "
        f"matmuls cover every batch and head at once (no Python loop over rows, single keys or heads)")


@pytest.mark.task_03_speed
def test_flash_attention_speed_within_tolerance_of_reference():
    forbid_calls(impl.flash_attention, ["scaled_dot_product_attention", "softmax", "naive_attention",
                                        "sdpa_attention", "get_attention", "minillm"])
    check_flash_speed(impl.flash_attention)


def _flash_row_at_a_time(q, k, v, causal=True, block_q=64, block_k=64):
    """Right values, but one query row per tile: 512 x 8 tiles of Python instead of 8 x 8."""
    return _tiled(q, k, v, causal, 1, block_k)


@grader_selftest
def test_speed_grader_accepts_the_compact_right_answer():
    check_flash_speed(_tiled)


@grader_selftest
@pytest.mark.parametrize("slow", [_flash_row_at_a_time])
def test_speed_grader_rejects_slow_loops(slow):
    with pytest.raises(AssertionError, match="allowed"):
        check_flash_speed(slow)


# =============================================================================== the real model, your flash attention


@pytest.mark.task_03_real_model
def test_your_flash_attention_runs_smollm2(real_model):
    """Your flash_attention (16 x 16 tiles, so the 37-token chat prompt spans three key tiles) as SmolLM2-135M's
    attention backend, float32: the chat prompt's logits within 1e-3 of the reference's, and generate()'s greedy
    tokens (prefill and every decode step) identical. Stands on exercise 00 (your norm, RoPE and sampler underneath
    where you wrote them, else minillm's)."""
    from tests.graders.real_model import check_attention_backend

    model, tok = real_model
    check_attention_backend(model, tok, impl, "SmolLM2 with your flash attention")
