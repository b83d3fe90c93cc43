"""Grader for exercise 11: the column- and row-parallel slices of a linear layer, the collectives of a
tensor-parallel forward, and the GPipe grid.

Everything is compared with oracles written here, not with minillm.parallel.tensor or minillm.parallel.pipeline.
The shard tasks simulate the ranks in this process: rank r's output x @ W_r.T (column parallel) or its partial
x_r @ W_r.T (row parallel), gathered by concatenation or by a plain sum (the all-reduce), against x @ W.T in float64,
then each shard against the block it must hold (`block_oracle`), on random shapes, dtypes and degrees 1-3. The
collectives run on ranks simulated by threads that exchange through `ThreadComm` (Comm's all_reduce / all_gather,
each call counted): every rank's output against the single-process layer in float64, and exactly the collectives
a forward needs (a forgotten all-reduce leaves a 1/degree share, a second one multiplies by the degree); then a
tiny random model sharded with your classes on 3 thread ranks. The GPipe grid is checked against `gpipe_oracle`, an
event-by-event simulation of the pipeline (a stage starts a micro-batch as soon as the previous stage has finished it
and the stage itself is free), and its rules are checked one by one on random sizes, so a wrong grid is named by the
rule it breaks.

The real-model task first runs your slices of SmolLM2's first block as three simulated ranks here (fast, with a
precise message), then the whole model with your slices and collectives on 3 thread ranks (the single-process
logits), then launches three real ranks (minillm.parallel.distributed.launch, gloo on CPU): each imports your module
by name, puts your slices and classes into minillm.parallel.tensor, and runs minillm.parallel.launch.rank_generate
with tp=3. The ranks must decode the single-process model's 16 greedy tokens of "The capital of France is".
"""

from __future__ import annotations

import copy
import threading
import time
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import minillm
import minillm.parallel.tensor
from tests.graders.conftest import TARGET, forbid_calls, load_impl
from tests.graders.real_model import one_thread, same_tokens

impl = load_impl("ex11_parallel")
LIBRARY = ["minillm", "tensor_parallel", "pipeline_parallel"]
DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def must_refuse(fn, *args, what: str, **kwargs) -> None:
    """fn(*args, **kwargs) must raise ValueError (a stub's NotImplementedError goes through unchanged)."""
    try:
        fn(*args, **kwargs)
    except ValueError:
        return
    except NotImplementedError:
        raise
    except Exception as e:  # any other error is the wrong one: say which
        raise AssertionError(f"{what}: raised {type(e).__name__} ({e}); expected a ValueError that says what is "
                             f"wrong, raised before any work is done") from e
    raise AssertionError(f"{what}: returned without an error; expected ValueError")


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ================================================================================================ task 11.shard


def block_oracle(weight: Tensor, rank: int, degree: int, dim: int) -> Tensor:
    """Contiguous block `rank` of `degree` equal blocks along `dim`, written out with explicit bounds."""
    n = weight.shape[dim] // degree
    idx = torch.arange(rank * n, rank * n + n)
    return weight.index_select(dim, idx)


def shard_hint(weight: Tensor, rank: int, degree: int, dim: int, got: Tensor) -> str:
    """Name the wrong answer `got` matches, when it matches a well-known one."""
    want = block_oracle(weight, rank, degree, dim)
    other = 1 - dim
    wrong_dim = (block_oracle(weight, rank, degree, other) if weight.shape[other] % degree == 0 else None)
    strided = weight[rank::degree] if dim == 0 else weight[:, rank::degree]
    kind = "rows (dim 0): the output features" if dim == 0 else "columns (dim 1): the input features"
    candidates = [
        (wrong_dim, f"the block along the other dimension: this slice splits W's {kind}"),
        (strided, (f"{'rows' if dim == 0 else 'columns'} {rank}, {rank} + {degree}, {rank} + {2 * degree}, ... "
                   f"(strided): rank r holds the contiguous block r, so that whole heads and whole channels stay "
                   f"together")),
        (want * degree, "the right block times degree: the all-reduce adds the partials, it does not average them"),
        (want / degree, "the right block divided by degree: the all-reduce adds the partials, nothing to rescale"),
        (weight, "the whole weight: slice it"),
    ]
    for value, why in candidates:
        if value is not None and value.shape == got.shape and value.dtype == got.dtype and \
                torch.equal(got, value) and not (value.shape == want.shape and torch.equal(value, want)):
            return f" = {why}"
    if got.shape == want.shape and got.shape[dim] > 0:
        for shift in (-1, 1):
            lo = rank * want.shape[dim] + shift
            if 0 <= lo and lo + want.shape[dim] <= weight.shape[dim]:
                moved = weight.narrow(dim, lo, want.shape[dim])
                if torch.equal(got, moved):
                    return f" = the block shifted by {shift} (an off-by-one in its bounds)"
    return ""


def take_shard(fn, weight: Tensor, rank: int, degree: int, dim: int, what: str) -> Tensor:
    """Call the learner's slice, check W is untouched and the shard is exactly block `rank` along `dim`."""
    before = weight.clone()
    shape, stride = tuple(weight.shape), weight.stride()
    got = fn(weight, rank, degree)
    case = f"{what}: {fn.__name__}(W {shape} {_dt(weight.dtype)}, rank={rank}, degree={degree})"
    if not (tuple(weight.shape) == shape and weight.stride() == stride and torch.equal(weight, before)):
        raise AssertionError(f"{case} changed W (shape {shape} -> {tuple(weight.shape)}, strides {stride} -> "
                             f"{weight.stride()}): the model still holds W while it is sliced; leave it as it was "
                             f"(no in-place ops on it, no transpose_ or t_)")
    assert isinstance(got, Tensor), f"{case} returned {type(got).__name__}, expected a tensor"
    want = block_oracle(weight, rank, degree, dim)
    assert got.dtype == weight.dtype, f"{case} returned {_dt(got.dtype)}: keep W's dtype"
    assert tuple(got.shape) == tuple(want.shape), (
        f"{case} has shape {tuple(got.shape)}, expected {tuple(want.shape)} (1/{degree} of W's "
        f"{'rows' if dim == 0 else 'columns'}){shard_hint(weight, rank, degree, dim, got)}")
    assert torch.equal(got, want), (
        f"{case} holds other values than W's {'rows' if dim == 0 else 'columns'} "
        f"[{rank * want.shape[dim]}, {(rank + 1) * want.shape[dim]}){shard_hint(weight, rank, degree, dim, got)}")
    assert got.is_contiguous(), (f"{case} is not contiguous (strides {got.stride()}): a column block of a row-major "
                                 f"matrix is strided in memory; the matmul and the send want contiguous memory")
    assert got.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr(), (
        f"{case} shares W's memory (a view): the rank would keep the whole W alive and save nothing; return a copy")
    return got


def _weights(out_f: int, in_f: int, lead: tuple[int, ...], dtype: torch.dtype, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g, dtype=torch.float64).to(dtype)
    x = torch.randn(*lead, in_f, generator=g, dtype=torch.float64)
    return w, x


def _close64(got: Tensor, want: Tensor) -> bool:
    return got.shape == want.shape and torch.allclose(got, want, rtol=1e-9, atol=1e-9 * (1 + want.abs().max().item()))


@pytest.mark.task_11_shard
def test_named_shards():
    """W (6, 6) with W[i, j] = 10 i + j: every entry says where it came from, so a wrong block is easy to read."""
    w = (10 * torch.arange(6)[:, None] + torch.arange(6)[None, :]).float()
    for degree in (1, 2, 3):
        for r in range(degree):
            take_shard(impl.column_slice, w, r, degree, 0, "column_slice of W[i, j] = 10 i + j")
            take_shard(impl.row_slice, w, r, degree, 1, "row_slice of W[i, j] = 10 i + j")


@pytest.mark.task_11_shard
def test_a_degree_that_does_not_divide_is_refused():
    w = torch.randn(6, 4)
    for fn, bad_dim, ok_dim in ((impl.column_slice, "rows", "columns"), (impl.row_slice, "columns", "rows")):
        wt = w if fn is impl.column_slice else w.T.contiguous()  # the dimension split has 6, the other 4
        for degree in (4, 5):
            must_refuse(fn, wt, 0, degree, what=f"{fn.__name__}(W {tuple(wt.shape)}, rank=0, degree={degree}): "
                                                f"{degree} does not divide W's 6 {bad_dim}")
        for rank in range(3):  # the other dimension (4) is not split: 3 must be accepted
            take_shard(fn, wt, rank, 3, 0 if fn is impl.column_slice else 1,
                       f"degree 3 splits W's 6 {bad_dim} (its 4 {ok_dim} are not split)")
    forbid_calls(impl.column_slice, LIBRARY)
    forbid_calls(impl.row_slice, LIBRARY)


@pytest.mark.task_11_shard
def test_smollm2_sized_heads_stay_whole():
    """wq of a SmolLM2-135M block (9 heads x 64 rows) at degree 3: rank r's rows are exactly heads 3r..3r+2."""
    g = torch.Generator().manual_seed(3)
    wq = torch.randn(9 * 64, 96, generator=g)
    for r in range(3):
        got = take_shard(impl.column_slice, wq, r, 3, 0, "wq of 9 heads of 64 rows, degree 3")
        heads = got.reshape(3, 64, 96)
        for j in range(3):
            assert torch.equal(heads[j], wq[(3 * r + j) * 64:(3 * r + j + 1) * 64]), (
                f"rank {r}'s local head {j} is not the model's head {3 * r + j}")


@st.composite
def column_cases(draw):
    """out_features a multiple of degree; in_features anything (column_slice must not care)."""
    degree = draw(st.sampled_from([1, 2, 3]))
    return (degree, degree * draw(st.integers(1, 6)), draw(st.integers(1, 13)),
            draw(st.sampled_from([(3,), (2, 3), (1, 1, 2)])), draw(st.sampled_from(DTYPES)),
            draw(st.integers(0, 2**16)))


@st.composite
def row_cases(draw):
    """in_features a multiple of degree; out_features anything (row_slice must not care)."""
    degree = draw(st.sampled_from([1, 2, 3]))
    return (degree, draw(st.integers(1, 13)), degree * draw(st.integers(1, 6)),
            draw(st.sampled_from([(3,), (2, 3), (1, 1, 2)])), draw(st.sampled_from(DTYPES)),
            draw(st.integers(0, 2**16)))


@pytest.mark.task_11_shard
@settings(max_examples=40, deadline=None)
@given(column_cases())
def test_column_parallel_outputs_concatenate_to_the_layer(case):
    degree, out_f, in_f, lead, dtype, seed = case
    w, x = _weights(out_f, in_f, lead, dtype, seed)
    what = f"column parallel, {degree} simulated ranks"
    shards = [take_shard(impl.column_slice, w, r, degree, 0, what) for r in range(degree)]
    y = torch.cat([x @ s.double().T for s in shards], dim=-1)  # each rank's slice of y, gathered in rank order
    assert _close64(y, x @ w.double().T), (
        f"{what}: concatenating x @ column_slice(W, r, {degree}).T over r = 0..{degree - 1} is not x @ W.T "
        f"(W {tuple(w.shape)}, x {tuple(x.shape)})")


@pytest.mark.task_11_shard
@settings(max_examples=40, deadline=None)
@given(row_cases())
def test_row_parallel_partials_sum_to_the_layer(case):
    degree, out_f, in_f, lead, dtype, seed = case
    w, x = _weights(out_f, in_f, lead, dtype, seed)
    what = f"row parallel, {degree} simulated ranks"
    n = in_f // degree
    shards = [take_shard(impl.row_slice, w, r, degree, 1, what) for r in range(degree)]
    y = sum(x[..., r * n:(r + 1) * n] @ s.double().T for r, s in enumerate(shards))  # the all-reduce: a sum
    assert _close64(y, x @ w.double().T), (
        f"{what}: the sum over r of x[..., r-th block] @ row_slice(W, r, {degree}).T is not x @ W.T "
        f"(W {tuple(w.shape)}, x {tuple(x.shape)})")


@pytest.mark.task_11_shard
def test_column_then_row_is_an_mlp_without_communication():
    """gate/up column parallel, down row parallel: rank r's channels meet rank r's rows of down, and one sum
    finishes the MLP (the engine's SwiGLU, in float64)."""
    g = torch.Generator().manual_seed(11)
    dim, ffn, degree = 8, 12, 3
    gate, up = (torch.randn(ffn, dim, generator=g, dtype=torch.float64) for _ in range(2))
    down = torch.randn(dim, ffn, generator=g, dtype=torch.float64)
    x = torch.randn(2, 5, dim, generator=g, dtype=torch.float64)
    want = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
    got = sum((torch.nn.functional.silu(x @ impl.column_slice(gate, r, degree).T)
               * (x @ impl.column_slice(up, r, degree).T))
              @ impl.row_slice(down, r, degree).T for r in range(degree))
    assert _close64(got, want), ("a SwiGLU MLP on 3 simulated ranks (gate and up by column_slice, down by row_slice, "
                                 "partials summed) differs from the whole MLP: the channels rank r computes must be "
                                 "the ones its slice of down reads")


# ================================================================================================ task 11.gpipe


def gpipe_oracle(n_stages: int, n_micro: int) -> list[list[int | None]]:
    """Simulate the pipeline time step by time step: a stage runs its next micro-batch when the stage before it
    finished that micro-batch at an earlier step (stage 0: when it exists). Stops when the last stage is done."""
    done_at = [[None] * n_micro for _ in range(n_stages)]  # done_at[r][i]: the step stage r ran micro-batch i
    next_micro = [0] * n_stages
    grid, t = [], 0
    while next_micro[-1] < n_micro:
        row = []
        for r in range(n_stages):
            i = next_micro[r]
            ready = i < n_micro and (r == 0 or (done_at[r - 1][i] is not None and done_at[r - 1][i] < t))
            if ready:
                done_at[r][i] = t
                next_micro[r] += 1
            row.append(i if ready else None)
        grid.append(row)
        t += 1
    return grid


def _show(grid) -> str:
    if not isinstance(grid, list) or len(grid) > 12:
        return repr(grid)[:400]
    return "\n" + "\n".join(f"    t={t}: {row}" for t, row in enumerate(grid))


def check_grid_type(got, p: int, what: str) -> None:
    assert isinstance(got, list) and all(isinstance(row, list) for row in got), (
        f"{what}: return a list of rows (lists), one per time step; got {type(got).__name__}")
    assert all(len(row) == p for row in got), (
        f"{what}: every row is one time step with one entry per stage ({p}); row lengths "
        f"{[len(row) for row in got]}. grid[t][r] is stage r at step t, not the other way round" +
        (" (this grid looks transposed)" if len(got) == p else ""))
    bad = {type(v).__name__ for row in got for v in row if not (v is None or type(v) is int)}
    assert not bad, f"{what}: entries must be micro-batch indices (int) or None for an idle slot, got {sorted(bad)}"


def check_gpipe(p: int, m: int, what: str) -> None:
    got = impl.gpipe_schedule(p, m)
    case = f"{what}: gpipe_schedule(n_stages={p}, n_micro={m})"
    check_grid_type(got, p, case)
    want = gpipe_oracle(p, m)
    assert got == want, f"{case} returned{_show(got)}\n  expected{_show(want)}{gpipe_hint(got, p, m)}"


def gpipe_hint(got, p: int, m: int) -> str:
    """The first pipeline rule `got` breaks, in words."""
    if any(v == -1 for row in got for v in row):
        return "\n  = -1 for an idle slot: an idle stage is None (-1 reads as a micro-batch index)"
    if len(got) != m + p - 1:
        return (f"\n  = {len(got)} time steps: micro-batch {m - 1} enters stage 0 at step {m - 1} and leaves the last "
                f"stage {p - 1} steps later, so the grid has m + p - 1 = {m + p - 1} rows")
    for r in range(p):
        col = [row[r] for row in got if row[r] is not None]
        if col != list(range(m)):
            return f"\n  = stage {r} runs {col}: every stage runs micro-batches 0..{m - 1}, in order, each once"
    at = {(row[r], r): t for t, row in enumerate(got) for r in range(p) if row[r] is not None}
    for r in range(1, p):
        for i in range(m):
            if at[(i, r)] <= at[(i, r - 1)]:
                return (f"\n  = stage {r} runs micro-batch {i} at step {at[(i, r)]}, but stage {r - 1} only runs it "
                        f"at step {at[(i, r - 1)]}: a stage needs the previous stage's output first")
    return "\n  = a valid pipeline, but not GPipe's: each stage starts a micro-batch as soon as it can"


@pytest.mark.task_11_gpipe
def test_gpipe_crafted_grids():
    check_gpipe(1, 1, "one stage, one micro-batch: no pipeline at all")
    check_gpipe(1, 4, "one stage: micro-batches one after another, never idle")
    check_gpipe(4, 1, "one micro-batch through four stages: each stage idles 3 of 4 steps")
    check_gpipe(3, 4, "three stages, four micro-batches")
    check_gpipe(2, 8, "two stages, eight micro-batches")
    assert impl.gpipe_schedule(3, 4) == [[0, None, None], [1, 0, None], [2, 1, 0], [3, 2, 1], [None, 3, 2],
                                         [None, None, 3]], "gpipe_schedule(3, 4), the grid drawn in the lesson"
    forbid_calls(impl.gpipe_schedule, LIBRARY)


@pytest.mark.task_11_gpipe
@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 10))
def test_gpipe_rules(p, m):
    got = impl.gpipe_schedule(p, m)
    case = f"gpipe_schedule(n_stages={p}, n_micro={m})"
    check_grid_type(got, p, case)
    shown = f"{case} returned{_show(got)}"
    assert len(got) == m + p - 1, f"{shown}\n  has {len(got)} rows{gpipe_hint(got, p, m)}"
    at = {}
    for r in range(p):
        col = [(t, row[r]) for t, row in enumerate(got) if row[r] is not None]
        assert [i for _, i in col] == list(range(m)), (
            f"{shown}\n  stage {r} runs {[i for _, i in col]}: every stage runs micro-batches 0..{m - 1} in order, "
            f"each exactly once")
        at.update({(i, r): t for t, i in col})
    for r in range(1, p):
        for i in range(m):
            assert at[(i, r)] > at[(i, r - 1)], (
                f"{shown}\n  stage {r} runs micro-batch {i} at step {at[(i, r)]}, before stage {r - 1} has run it "
                f"(step {at[(i, r - 1)]})")
    idle = sum(v is None for row in got for v in row)
    assert idle == p * (p - 1), f"{shown}\n  has {idle} idle slots; the GPipe bubble is p(p - 1) = {p * (p - 1)}"
    assert abs(idle / (p * len(got)) - (p - 1) / (m + p - 1)) < 1e-12
    assert got == gpipe_oracle(p, m), f"{shown}\n  expected{_show(gpipe_oracle(p, m))}{gpipe_hint(got, p, m)}"


@pytest.mark.task_11_gpipe
def test_gpipe_refuses_an_empty_pipeline():
    for p, m in ((0, 3), (3, 0), (0, 0), (-1, 2), (2, -1)):
        must_refuse(impl.gpipe_schedule, p, m, what=f"gpipe_schedule(n_stages={p}, n_micro={m}): a pipeline needs "
                                                    f"at least one stage and one micro-batch")


# ========================================================================================= task 11.collectives


class ThreadGroup:
    """`degree` ranks simulated by threads of this process: each posts its tensor, waits for the others, reads all."""

    def __init__(self, degree: int):
        self.degree, self.slots = degree, [None] * degree
        self.barrier = threading.Barrier(degree, timeout=120)


class ThreadComm:
    """minillm.parallel.distributed.Comm's all_reduce / all_gather between thread ranks, each call counted. Every
    rank adds the parts in rank order, so all ranks hold bit-identical sums (as a real all-reduce promises)."""

    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank, self.world_size = group, rank, group.degree
        self.calls: Counter = Counter()

    def _exchange(self, x: Tensor) -> list[Tensor]:
        g = self.group
        g.slots[self.rank] = x.detach().clone()
        g.barrier.wait()
        parts = list(g.slots)
        g.barrier.wait()  # every rank has read the slots before the next exchange writes them
        return parts

    def all_reduce(self, x: Tensor) -> Tensor:
        self.calls["all_reduce"] += 1
        parts = self._exchange(x)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        x.copy_(total)
        return x

    def all_gather(self, x: Tensor, dim: int) -> Tensor:
        self.calls["all_gather"] += 1
        return torch.cat(self._exchange(x), dim=dim)

    def reduce_scatter(self, x: Tensor, dim: int) -> Tensor:
        self.calls["reduce_scatter"] += 1
        raise AssertionError("a tensor-parallel forward has no reduce-scatter (that is sequence parallelism)")


def run_ranks(degree: int, fn) -> list:
    """fn(rank, comm) on `degree` thread ranks; their results in rank order, or the first rank's error re-raised."""
    group = ThreadGroup(degree)
    comms = [ThreadComm(group, r) for r in range(degree)]
    results, errors = [None] * degree, [None] * degree

    def main(r: int) -> None:
        torch.set_num_threads(1)
        try:
            with torch.inference_mode():
                results[r] = (fn(r, comms[r]), comms[r].calls)
        except BaseException as e:  # noqa: BLE001  (re-raised in the grading thread below)
            errors[r] = e
            group.barrier.abort()  # the other ranks would wait for this one's collective forever

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(degree)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)),
                 next((e for e in errors if e is not None), None))
    if isinstance(first, threading.BrokenBarrierError):
        raise AssertionError("the ranks made different numbers of collective calls and one waited for the others "
                             "forever: every rank must call the same collectives in the same order")
    if first is not None:
        raise first
    return results


@pytest.fixture
def reference_slices(monkeypatch):
    """Your classes' given __init__ slice with this module's row_slice: task 11.shard's grader grades yours, this
    task uses minillm's (a task that needs another task's code uses the reference)."""
    monkeypatch.setattr(impl, "row_slice", minillm.parallel.tensor.row_slice, raising=False)


def _calls(counted: Counter, what: str, **want: int) -> None:
    got = {k: v for k, v in counted.items() if v}
    assert got == {k: v for k, v in want.items() if v}, f"{what}: collectives called {got or 'none'}, expected " \
                                                         f"{ {k: v for k, v in want.items() if v} or 'none'}"


@pytest.mark.task_11_collectives
@pytest.mark.parametrize("degree", [1, 2, 3])
def test_row_parallel_linear_all_reduces_once(degree, reference_slices):
    g = torch.Generator().manual_seed(degree)
    w = torch.randn(10, 6 * degree, generator=g, dtype=torch.float64)
    x = torch.randn(2, 5, 6 * degree, generator=g, dtype=torch.float64)
    want = x @ w.T
    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.float64)
    linear.weight.data.copy_(w)
    n = w.shape[1] // degree

    def rank(r, comm):
        x_r = x[..., r * n:(r + 1) * n]
        whole = impl.RowParallelLinear(linear, r, degree, comm)(x_r.clone())
        calls_whole = dict(comm.calls)
        part = impl.RowParallelLinear(linear, r, degree, comm, reduce=False)(x_r.clone())
        return whole, calls_whole, part, x_r @ w[:, r * n:(r + 1) * n].T

    for r, ((whole, calls_whole, part, want_part), calls) in enumerate(run_ranks(degree, rank)):
        case = f"degree {degree}, rank {r}: RowParallelLinear(W {tuple(w.shape)})(x_r {tuple(x[..., :n].shape)})"
        _calls(Counter(calls_whole), f"{case} with reduce=True", all_reduce=1)
        assert torch.is_tensor(whole) and whole.shape == want.shape, (
            f"{case}: output {getattr(whole, 'shape', whole)}, expected {tuple(want.shape)}")
        err = (whole - want).abs().max().item()
        ratio = (whole.abs().sum() / want.abs().sum()).item()
        assert err <= 1e-9, (f"{case}: differs from the whole layer x @ W.T by {err:.3g} on this rank (|output| / "
                             f"|expected| = {ratio:.3g}: {degree}.0 is a sum taken twice, {1 / degree:.3g} a partial "
                             f"never summed)")
        _calls(calls - Counter(calls_whole), f"{case} with reduce=False")
        assert torch.is_tensor(part) and part.shape == want.shape and (part - want_part).abs().max().item() <= 1e-9, (
            f"{case} with reduce=False must return the rank's own partial product x_r @ W_r.T, uncommunicated")
    forbid_calls(impl.RowParallelLinear.forward, LIBRARY)


@pytest.mark.task_11_collectives
@pytest.mark.parametrize("degree", [1, 2, 3])
def test_vocab_parallel_embedding_and_head(degree):
    g = torch.Generator().manual_seed(10 + degree)
    vocab, dim = 4 * degree, 5
    w = torch.randn(vocab, dim, generator=g, dtype=torch.float64)
    ids = torch.tensor([[0, vocab - 1, 3 % vocab, 4 % vocab], [vocab // 2, 1, vocab - 2, 0]])
    h = torch.randn(2, 3, dim, generator=g, dtype=torch.float64)
    n = vocab // degree

    def rank(r, comm):
        emb = impl.VocabParallelEmbedding(w, r, degree, comm)
        part = emb.partial(ids)
        after_partial = dict(comm.calls)
        whole = emb(ids)
        after_embed = dict(comm.calls)
        logits = impl.VocabParallelHead(emb.weight, comm)(h)
        return part, after_partial, whole, after_embed, logits

    want_rows, want_logits = torch.nn.functional.embedding(ids, w), h @ w.T
    for r, ((part, after_partial, whole, after_embed, logits), calls) in enumerate(run_ranks(degree, rank)):
        case = f"degree {degree}, rank {r} (ids {r * n}..{r * n + n - 1} of {vocab})"
        _calls(Counter(after_partial), f"{case}: VocabParallelEmbedding.partial")
        mine = ((ids >= r * n) & (ids < r * n + n))[..., None]
        want_part = torch.where(mine, want_rows, torch.zeros_like(want_rows))
        assert torch.is_tensor(part) and part.shape == want_part.shape, (
            f"{case}: partial({ids.tolist()}) has shape {getattr(part, 'shape', part)}, expected "
            f"{tuple(want_part.shape)}")
        assert torch.equal(part, want_part), (
            f"{case}: partial({ids.tolist()}) must hold the rows of this rank's ids and zeros for every other id; "
            f"wrong at (row, position) {(part != want_part).any(-1).nonzero().tolist()}")
        _calls(Counter(after_embed), f"{case}: VocabParallelEmbedding.forward", all_reduce=1)
        assert torch.is_tensor(whole) and whole.shape == want_rows.shape and \
            (whole - want_rows).abs().max().item() <= 1e-12, (
            f"{case}: the embedding of {ids.tolist()} must be the whole table's rows on every rank")
        _calls(calls - Counter(after_embed), f"{case}: VocabParallelHead.forward", all_gather=1)
        assert torch.is_tensor(logits) and logits.shape == want_logits.shape, (
            f"{case}: the head's logits have shape {getattr(logits, 'shape', logits)}, expected "
            f"{tuple(want_logits.shape)} (every rank gets the whole vocabulary)")
        assert (logits - want_logits).abs().max().item() <= 1e-9, (
            f"{case}: the head's logits differ from h @ W.T (the ranks' blocks, side by side in rank order)")
    for fn in (impl.VocabParallelEmbedding.partial, impl.VocabParallelEmbedding.forward,
               impl.VocabParallelHead.forward):
        forbid_calls(fn, LIBRARY)


TINY = {"n_heads": 6, "n_kv_heads": 3, "dim": 48, "ffn_dim": 96, "vocab_size": 384, "n_layers": 3, "max_seq_len": 64}


def thread_ranks_logits(model, ids: list[int], degree: int) -> list[tuple[Tensor, Counter]]:
    """`model` sharded with minillm.parallel.tensor.shard_tensor_parallel (whatever slices and classes it holds now)
    on `degree` thread ranks: each rank's logits of `ids` and the collectives it called in the forward."""
    from minillm.parallel.tensor import shard_tensor_parallel

    copies = [copy.deepcopy(model) for _ in range(degree)]

    def rank(r, comm):
        shard_tensor_parallel(copies[r], comm)
        comm.calls.clear()
        return copies[r](torch.tensor([ids]))

    return [(logits, calls) for logits, calls in run_ranks(degree, rank)]


def check_tp_model(model, ids, degree: int, atol: float, what: str) -> None:
    with torch.inference_mode():
        want = model(torch.tensor([ids]))
    blocks = len(model.layers)
    for r, (logits, calls) in enumerate(thread_ranks_logits(model, ids, degree)):
        case = f"{what}, tp={degree}, rank {r}"
        _calls(calls, f"{case}: one forward ({blocks} blocks)", all_reduce=2 * blocks + 1, all_gather=1)
        assert logits.shape == want.shape, f"{case}: logits {tuple(logits.shape)}, expected {tuple(want.shape)}"
        err = (logits - want).abs().max().item()
        assert err <= atol, f"{case}: the logits differ from the single-process model's by up to {err:.3g} (> {atol})"


@pytest.mark.task_11_collectives
def test_tiny_model_on_three_thread_ranks(reference_slices, monkeypatch):
    """A random tiny model (6 query / 3 KV heads: attention splits at tp=3) sharded with your three classes: the
    single-process logits on every rank, with 2 all-reduces per block, 1 for the embedding and 1 all-gather."""
    from minillm.gguf.loader import load_spec

    for name in ("RowParallelLinear", "VocabParallelEmbedding", "VocabParallelHead"):
        monkeypatch.setattr(minillm.parallel.tensor, name, getattr(impl, name))
    model, _ = load_spec({"tiny": TINY, "seed": 0}, "float64")
    check_tp_model(model, [(7 * i + 3) % TINY["vocab_size"] for i in range(9)], 3, 1e-9, "a tiny random model")


# ============================================================================================ task 11.real_model

_PROMPT = "The capital of France is"
_NEW = 16
_DEGREE = 3  # SmolLM2-135M: 9 query heads, 3 KV heads: attention splits too (at 2 it would be replicated)


def _tp_rank(rank: int, world_size: int, target: str, prompt_ids: list[int], n_new: int) -> dict:
    """One rank of the real-model task (runs in a fresh process started by launch, which imports this module by
    name): your column_slice, row_slice and collectives' classes put into minillm.parallel.tensor, then the engine's
    rank loop."""
    import importlib

    import minillm.parallel.tensor as tp
    from minillm.parallel.launch import ParallelConfig, rank_generate
    from minillm.sampling import SamplingParams

    learner = importlib.import_module(f"{target}.ex11_parallel")
    calls = {"column_slice": 0, "row_slice": 0}
    for name in ("RowParallelLinear", "VocabParallelEmbedding", "VocabParallelHead"):
        setattr(tp, name, getattr(learner, name))

    def counted(name):
        fn = getattr(learner, name)

        def wrapper(weight, rank, degree):
            calls[name] += 1
            return fn(weight, rank, degree)
        return wrapper

    # minillm's column_shard reads tp.column_slice; your RowParallelLinear's __init__ reads your module's row_slice
    tp.column_slice, tp.row_slice = counted("column_slice"), counted("row_slice")
    learner.row_slice = tp.row_slice
    request = (prompt_ids, SamplingParams(max_tokens=n_new), frozenset())  # greedy, no stop token
    (out,) = rank_generate(rank, world_size, "smollm2-135m", [request], ParallelConfig(tp=world_size), "float32")
    return {"token_ids": out["token_ids"], "first_logits": out["first_logits"], "calls": calls,
            "prefill_s": out["prefill_s"], "decode_s": out["decode_s"]}


def _simulated_block0(model, ids: list[int], degree: int) -> None:
    """SmolLM2's block 0, attention and MLP, as `degree` ranks in this process: the engine's own shards
    (column_shard, RowParallelLinear without its all-reduce) built from your slices, the partials summed here."""
    from minillm.parallel.tensor import RowParallelLinear, column_shard

    blk = model.layers[0]
    with torch.inference_mode():
        x = model.embed_tokens(torch.tensor([ids]))
        pos = torch.arange(len(ids))[None]
        cos, sin = model.rope_cos[pos][:, None], model.rope_sin[pos][:, None]
        h = blk.attn_norm(x)
        for part in ("attn", "mlp"):
            full = getattr(blk, part)
            want = full(h, cos, sin, model._attn, 0, None) if part == "attn" else full(h)
            partials = []
            for r in range(degree):
                mod = copy.deepcopy(full)
                names = ("wq", "wk", "wv", "wo") if part == "attn" else ("gate", "up", "down")
                for name in names[:-1]:
                    w = getattr(full, name).weight
                    shard = column_shard(getattr(full, name), r, degree)
                    assert shard.weight.shape == (w.shape[0] // degree, w.shape[1]), (
                        f"{part}.{name} {tuple(w.shape)} at degree {degree}: your column_slice gave rank {r} "
                        f"{tuple(shard.weight.shape)}")
                    setattr(mod, name, shard)
                last = getattr(full, names[-1])
                row = RowParallelLinear(last, r, degree, comm=None, reduce=False)
                assert row.weight.shape == (last.weight.shape[0], last.weight.shape[1] // degree), (
                    f"{part}.{names[-1]} {tuple(last.weight.shape)} at degree {degree}: your row_slice gave rank {r} "
                    f"{tuple(row.weight.shape)}")
                setattr(mod, names[-1], row)
                if part == "attn":
                    mod.n_heads, mod.n_kv_heads = full.n_heads // degree, full.n_kv_heads // degree
                    partials.append(mod(h, cos, sin, model._attn, 0, None))
                else:
                    partials.append(mod(h))
            got = sum(partials)
            err, scale = (got - want).abs().max().item(), want.abs().max().item()
            if not err <= 1e-4 * (1 + scale):  # the reference: about 1e-7 * scale (float32, another summation order)
                raise AssertionError(f"SmolLM2's block 0 {part} on {degree} simulated ranks (your slices, the partials "
                                     f"summed) differs from the whole {part} by up to {err:.3g} (outputs up to "
                                     f"{scale:.3g})")


@pytest.mark.task_11_real_model
def test_your_slices_run_smollm2_on_three_ranks(request, monkeypatch):
    """SmolLM2 sharded with your column_slice, row_slice and collectives: block 0 on 3 simulated ranks, then the whole
    model on 3 thread ranks here (the single-process logits, the collectives a forward needs), then three real ranks
    that decode greedily: the tokens must be the single-process model's, Paris included."""
    from minillm.parallel.distributed import launch

    impl.column_slice(torch.zeros(3, 2), 0, 3), impl.row_slice(torch.zeros(2, 3), 0, 3)  # a stub fails before the load
    impl.RowParallelLinear(torch.nn.Linear(3, 2, bias=False), 0, 3, None, reduce=False)(torch.zeros(1))
    model, tok = request.getfixturevalue("real_model")
    ids = tok.encode(_PROMPT)
    with monkeypatch.context() as m:
        m.setattr(minillm.parallel.tensor, "column_slice", impl.column_slice)
        m.setattr(minillm.parallel.tensor, "row_slice", impl.row_slice)
        one_thread(_simulated_block0)(model, ids, _DEGREE)
        for name in ("RowParallelLinear", "VocabParallelEmbedding", "VocabParallelHead"):
            m.setattr(minillm.parallel.tensor, name, getattr(impl, name))
        check_tp_model(model, ids, _DEGREE, 1e-3, "SmolLM2 on thread ranks with your slices and collectives")

    want = one_thread(minillm.generate)(model, tok, ids, max_new_tokens=_NEW, ignore_eos=True).token_ids
    with torch.inference_mode():
        want_logits = one_thread(model)(torch.tensor([ids]), last_only=True)[0, -1]
    t0 = time.perf_counter()
    try:
        ranks = launch(_tp_rank, _DEGREE, TARGET, ids, _NEW, threads=1, timeout_s=300.0)
    except RuntimeError as e:
        raise AssertionError(f"the tensor-parallel run with your slices failed on a rank:\n{str(e)[-3000:]}") from None
    wall = time.perf_counter() - t0
    print(f"\n{_DEGREE} ranks: {wall:.1f} s in all (start, load, shard), prefill {ranks[0]['prefill_s']:.2f} s, "
          f"decode {ranks[0]['decode_s']:.2f} s; your slices were called {ranks[0]['calls']} times per rank.\n"
          f"They say: {_PROMPT!r} ->{tok.decode(ranks[0]['token_ids'])!r}")
    for res in ranks:
        assert res["calls"]["column_slice"] > 0 and res["calls"]["row_slice"] > 0, (
            f"rank {ranks.index(res)} never called your slices ({res['calls']}): the grader's plumbing is broken")
    for r, res in enumerate(ranks):
        same_tokens(res["token_ids"], want, tok, f"rank {r} of {_DEGREE} (tp={_DEGREE}, your slices)")
    err = (ranks[0]["first_logits"] - want_logits).abs().max().item()
    assert err <= 2e-3, (f"the prompt's last logits on {_DEGREE} ranks differ from the single-process model's by up "
                         f"to {err:.3g}")
    assert "Paris" in tok.decode(ranks[0]["token_ids"])
