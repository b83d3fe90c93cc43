"""Parallelism (lesson 11): tensor, sequence and pipeline parallelism give the single process's tokens and logits,
the collectives move exactly the bytes the formulas say, and a failing rank fails the whole run fast.

Four layers, cheapest first:
  1. pure functions (plans, slices, schedules, bubble formula, config refusals), in process;
  2. the real shard code (shard_tensor_parallel, sequence parallelism, pipeline stages) on p *threads* of this
     process, joined by a small in-memory stand-in for Comm: every rank's logits at every step against the full
     model, in about a second, no process started;
  3. real ranks (torch.multiprocessing + gloo, through `launch` / `generate_parallel`) on tiny random models:
     tokens, logits, and the measured byte counts against the formulas; fail-fast behaviour;
  4. SmolLM2-135M end to end (slow).
Starting ranks is the expensive part here (each one imports torch: 10-20 s per launch on a loaded 2-core machine),
so each launch below checks several configurations; the rank functions are module-level so the spawned ranks can
import them (pytest puts this directory on sys.path, and spawn hands sys.path to the children).
"""

from __future__ import annotations

import copy
import itertools
import os
import queue
import signal
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from minillm.config import SMOLLM2_135M, ModelConfig
from minillm.parallel.distributed import Comm, check_same_weights, free_port, init_group, launch, weights_checksum
from minillm.api import generate_ids
from minillm.kv_cache import KVCache
from minillm.model import Transformer
from minillm.gguf.loader import load_spec
from minillm.parallel.launch import ParallelConfig, generate_parallel, validate
from minillm.parallel.pipeline import (PipelineStage, bubble_fraction, gpipe_schedule, measured_bubble,
                                       pipeline_prefill, stage_bounds)
from minillm.sampling import SamplingParams
from minillm.request import RequestOutput
from minillm.parallel.sequence import enable_sequence_parallel, prefill_sp, residual_bytes, sp_forward
from minillm.parallel.tensor import (RowParallelLinear, TPPlan, VocabParallelEmbedding, column_shard, column_slice,
                                     row_slice, shard_tensor_parallel, tp_bytes_per_token)

_load_spec = load_spec  # the original: the ranks below patch minillm.parallel.launch.load_spec

# 6 query heads / 3 KV heads: attention splits at tp=3, is replicated at tp=2 (SmolLM2's 9/3 in miniature);
# ffn 96 and vocab 384 divide by 2 and 3; 4 blocks make pp=3 uneven (2, 1, 1)
TINY = {"n_heads": 6, "n_kv_heads": 3, "dim": 48, "ffn_dim": 96, "vocab_size": 384, "n_layers": 4, "max_seq_len": 64}
# A random tiny model repeats its last prompt token forever (the embedding dominates the residual stream), which
# would make "same tokens" vacuous; with the blocks' matrices scaled up 4x the greedy tokens vary at every step.
LIVELY = {"tiny": TINY, "seed": 0, "block_scale": 4.0}
PROMPT = [(7 * i + 3) % TINY["vocab_size"] for i in range(11)]
F32 = 4


def _load_lively(spec, dtype: str = "float32", device="cpu"):
    """load_spec plus two test-only keys: block_scale (see LIVELY) and seed_per_rank (rank r uses seed + r:
    ranks holding different weights)."""
    spec = dict(spec)
    if spec.pop("seed_per_rank", False):
        spec["seed"] = spec.get("seed", 0) + dist.get_rank()
    scale = spec.pop("block_scale", 1.0)
    model, tok = _load_spec(spec, dtype, device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("layers.") and p.dim() == 2:
                p.mul_(scale)
    return model


def reference(spec, prompt, n_new):
    """Single process: greedy tokens (no stop ids), logits at the prompt's last position, and the model."""
    model = _load_lively(spec)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt]))[0, -1]
    tokens = list(generate_ids(model, prompt, SamplingParams(max_tokens=n_new, temperature=0.0)))
    return tokens, logits, model


def max_diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def tol(want, rel: float = 2e-5) -> float:
    """fp32 tolerance for logits summed in another order: rel x their scale (the lively model's reach ~20)."""
    return rel * (1 + float(want.abs().max()))


# ============================================================================ 1. pure functions, in process


@pytest.mark.parametrize("degree,split", [(1, True), (2, False), (3, True), (4, False), (6, False)])
def test_tp_plan_smollm2(degree, split):
    cfg = SMOLLM2_135M
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size) == (9, 3, 1536, 49152)
    plan = TPPlan.for_config(cfg, degree)
    assert plan == TPPlan(degree, split)
    assert ("replicated" in plan.describe(cfg)) is not split


@pytest.mark.parametrize("degree,field", [(5, "ffn_dim"), (7, "ffn_dim"), (9, "vocab_size")])
def test_tp_plan_refuses_degrees_that_do_not_divide(degree, field):
    cfg = SMOLLM2_135M if field == "ffn_dim" else ModelConfig.tiny(ffn_dim=18 * 8, vocab_size=500)
    with pytest.raises(ValueError, match=field):
        TPPlan.for_config(cfg, degree)


@pytest.mark.parametrize("degree", [0, -1, 2.0, "2"])
def test_tp_plan_refuses_non_degrees(degree):
    with pytest.raises(ValueError, match="integer"):
        TPPlan.for_config(SMOLLM2_135M, degree)


def test_tp_bytes_per_token_smollm2():
    # split attention: two all-reduces per block (after wo, after down) + one for the embedding; one all-gather of
    # the vocabulary for the logits. Replicated attention (tp=2): only the MLP's all-reduce per block.
    cfg = SMOLLM2_135M
    assert tp_bytes_per_token(cfg, TPPlan.for_config(cfg, 3)) == {"all_reduce": 61 * 576 * 4,
                                                                   "all_gather": 49152 * 4}
    assert tp_bytes_per_token(cfg, TPPlan.for_config(cfg, 2)) == {"all_reduce": 31 * 576 * 4,
                                                                   "all_gather": 49152 * 4}
    assert tp_bytes_per_token(cfg, TPPlan.for_config(cfg, 3), dtype_bytes=2)["all_reduce"] == 61 * 576 * 2


def test_residual_bytes():
    cfg = ModelConfig.tiny(**TINY)
    assert residual_bytes(cfg, 12, 3, sequence_parallel=False) == 12 * 48 * F32
    assert residual_bytes(cfg, 12, 3, sequence_parallel=True) == 4 * 48 * F32


@pytest.mark.parametrize("kwargs,match", [
    ({"tp": 2, "pp": 2}, "not both"),
    ({"sp": True}, "tp >= 2"),
    ({"tp": 1, "pp": 3, "sp": True}, "tp >= 2"),
    ({"tp": 0}, "tp must be"), ({"tp": -2}, "tp must be"), ({"pp": 0}, "pp must be"),
    ({"tp": True}, "tp must be"), ({"pp": False}, "pp must be"), ({"tp": 2.0}, "tp must be"),
    ({"micro_batches": 0}, "micro_batches"), ({"micro_batches": True}, "micro_batches"),
])
def test_parallel_config_refusals(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)


def test_parallel_config_world_size():
    assert ParallelConfig(tp=3, sp=True).world_size == 3
    assert ParallelConfig(pp=4).world_size == 4
    assert ParallelConfig().world_size == 1


def test_stage_bounds_examples():
    assert stage_bounds(30, 3) == [(0, 10), (10, 20), (20, 30)]
    assert stage_bounds(4, 3) == [(0, 2), (2, 3), (3, 4)]
    assert stage_bounds(5, 5) == [(i, i + 1) for i in range(5)]
    for bad in (0, 6, -1):
        with pytest.raises(ValueError, match="stages"):
            stage_bounds(5, bad)


@given(n_layers=st.integers(1, 64), data=st.data())
def test_stage_bounds_property(n_layers, data):
    p = data.draw(st.integers(1, n_layers))
    bounds = stage_bounds(n_layers, p)
    assert len(bounds) == p and bounds[0][0] == 0 and bounds[-1][1] == n_layers
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))  # contiguous
    sizes = [e - s for s, e in bounds]
    assert sum(sizes) == n_layers and min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the first stages take the extra blocks
    with pytest.raises(ValueError):
        stage_bounds(n_layers, n_layers + 1 + data.draw(st.integers(0, 3)))


@given(p=st.integers(1, 8), m=st.integers(1, 16))
def test_gpipe_schedule_property(p, m):
    grid = gpipe_schedule(p, m)
    assert len(grid) == m + p - 1 and all(len(row) == p for row in grid)
    cells = [(r, grid[t][r]) for t in range(len(grid)) for r in range(p) if grid[t][r] is not None]
    assert sorted(cells) == [(r, i) for r in range(p) for i in range(m)]  # every (stage, micro) exactly once
    for t, row in enumerate(grid):
        for r, micro in enumerate(row):
            assert micro == (t - r if 0 <= t - r < m else None)  # stage r runs micro-batch t - r
    idle = sum(micro is None for row in grid for micro in row)
    assert idle == p * (p - 1)
    assert bubble_fraction(p, m) == pytest.approx(idle / (p * len(grid)))


def test_gpipe_schedule_refusals_and_values():
    assert gpipe_schedule(2, 2) == [[0, None], [1, 0], [None, 1]]
    assert bubble_fraction(1, 5) == 0 and bubble_fraction(4, 1) == pytest.approx(0.75)
    for p, m in ((0, 1), (1, 0)):
        with pytest.raises(ValueError):
            gpipe_schedule(p, m)


@given(p=st.integers(1, 6), m=st.integers(1, 12), slot=st.floats(1e-3, 10), t0=st.floats(0, 1e4))
def test_measured_bubble_of_a_perfect_schedule_is_the_formula(p, m, slot, t0):
    # stage r computes micro-batch i in time slot i + r, exactly the GPipe grid
    events = [[(i, t0 + (i + r) * slot, t0 + (i + r + 1) * slot) for i in range(m)] for r in range(p)]
    assert measured_bubble(events) == pytest.approx(bubble_fraction(p, m), abs=1e-6)


def test_measured_bubble_no_overlap():
    # two stages that never overlap (no pipelining at all): each is idle half the time
    events = [[(0, 0.0, 1.0)], [(0, 1.0, 2.0)]]
    assert measured_bubble(events) == pytest.approx(0.5)


@given(degree=st.integers(1, 4), n_out=st.integers(1, 5), n_in=st.integers(1, 5), rows=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_column_and_row_slices_reassemble(degree, n_out, n_in, rows, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(degree * n_out, degree * n_in, generator=g, dtype=torch.float64)
    x = torch.randn(2, rows, degree * n_in, generator=g, dtype=torch.float64)
    full = x @ w.T
    cols = [column_slice(w, r, degree) for r in range(degree)]
    assert all(c.shape == (n_out, degree * n_in) and c.is_contiguous() for c in cols)
    torch.testing.assert_close(torch.cat([x @ c.T for c in cols], dim=-1), full, rtol=1e-12, atol=1e-12)
    parts = [x[..., r * n_in:(r + 1) * n_in] @ row_slice(w, r, degree).T for r in range(degree)]
    assert all(row_slice(w, r, degree).is_contiguous() for r in range(degree))
    torch.testing.assert_close(sum(parts), full, rtol=1e-12, atol=1e-12)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind tensors: what they keep alive, views included."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


@pytest.mark.parametrize("degree", [1, 3])
def test_slices_are_copies(degree):
    # a view would keep the whole matrix alive on every rank (fixed in 9618cbb: column_slice's row range is already
    # contiguous, so .contiguous() copied nothing)
    w = torch.randn(12, 6)
    for s in (column_slice(w, degree - 1, degree), row_slice(w, degree - 1, degree)):
        assert s.is_contiguous() and s.untyped_storage().nbytes() == s.numel() * 4
        assert s.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()


def test_tensor_parallel_shard_holds_only_its_slice():
    # SmolLM2 at tp=3 with views: 365 MB of storage held per rank for 179 MB of shard parameters
    import types

    shard = lively_model()
    shard_tensor_parallel(shard, types.SimpleNamespace(rank=0, world_size=3))  # sharding itself communicates nothing
    params = list(shard.parameters())
    assert storage_bytes(params) == sum(p.numel() * p.element_size() for p in params)


def test_slices_refuse_uneven_splits():
    w = torch.zeros(6, 4)
    with pytest.raises(ValueError, match="output features"):
        column_slice(w, 0, 4)
    with pytest.raises(ValueError, match="input features"):
        row_slice(w, 0, 3)


# ============================================================================ 2. shard math, in process


def lively_model(**overrides) -> Transformer:
    return _load_lively({"tiny": {**TINY, **overrides}, "seed": 0, "block_scale": 4.0})


@pytest.mark.parametrize("p", [1, 3])
def test_block_from_hand_sharded_weights(p):
    # rank r: q/k/v and gate/up column slices (whole heads, 1/p of the channels), wo and down row slices; the block
    # output is x + sum_r attn_r(norm(x)), then h + sum_r mlp_r(norm(h)): the sums are the all-reduces
    model = lively_model().double()  # float64: only the summation order differs, so the match is ~1e-15
    block, cfg = model.layers[0], model.config
    x = torch.randn(1, 7, cfg.dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    cos, sin = model.rope_cos[:7][None, None], model.rope_sin[:7][None, None]

    def shard_attn(r):
        a = copy.deepcopy(block.attn)
        for name in ("wq", "wk", "wv"):
            setattr(a, name, column_shard(getattr(block.attn, name), r, p))
        a.wo = RowParallelLinear(block.attn.wo, r, p, comm=None, reduce=False)
        a.n_heads, a.n_kv_heads = cfg.n_heads // p, cfg.n_kv_heads // p
        return a

    def shard_mlp(r):
        m = copy.deepcopy(block.mlp)
        m.gate, m.up = column_shard(block.mlp.gate, r, p), column_shard(block.mlp.up, r, p)
        m.down = RowParallelLinear(block.mlp.down, r, p, comm=None, reduce=False)
        return m

    with torch.inference_mode():
        expected = block(x, cos, sin, model._attn, 0, None)
        h = x + sum(shard_attn(r)(block.attn_norm(x), cos, sin, model._attn, 0, None) for r in range(p))
        out = h + sum(shard_mlp(r)(block.mlp_norm(h)) for r in range(p))
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    assert shard_attn(p - 1).wq.weight.shape == (cfg.n_heads // p * cfg.head_dim, cfg.dim)


def test_vocab_parallel_embedding_partials():
    model, p = lively_model(), 3
    ids = torch.tensor([[0, 127, 128, 255, 256, 383, 5]])
    parts = [VocabParallelEmbedding(model.embed.weight, r, p, comm=None).partial(ids) for r in range(p)]
    owners = torch.stack([(t != 0).any(-1) for t in parts])  # (p, 1, s): which ranks produced each position
    assert owners.sum(0).eq(1).all(), "every id must come from exactly one rank (zeros from the others)"
    assert owners[:, 0].int().argmax(0).tolist() == [0, 0, 1, 1, 2, 2, 0]
    torch.testing.assert_close(sum(parts), model.embed(ids), rtol=0, atol=0)


class _Threads:
    """p ranks as p threads of this process, sharing memory instead of a network: enough of Comm's interface
    (rank, world_size, all_reduce, all_gather, reduce_scatter, send/recv, broadcast) to run the real shard code.
    Every op is collective in the same order on every rank, as with torch.distributed."""

    def __init__(self, p: int):
        self.p = p
        self.barrier = threading.Barrier(p, timeout=60)
        self.slots: list = [None] * p
        self.mail = {(s, d): queue.Queue() for s in range(p) for d in range(p)}
        self.ops: list = [[] for _ in range(p)]  # op names per rank, in order

    def run(self, fn):
        """fn(comm) on every rank, each in its own thread; results in rank order; a rank's error is re-raised."""
        results, errors = [None] * self.p, [None] * self.p

        def body(r):
            try:
                with torch.inference_mode():
                    results[r] = fn(_ThreadComm(self, r))
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors[r] = e
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.p)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a simulated rank hung"
        first = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
        if first or any(errors):
            raise (first or [e for e in errors if e is not None])[0]
        return results


class _ThreadComm:
    def __init__(self, group: _Threads, rank: int):
        self.group, self.rank, self.world_size = group, rank, group.p

    def _exchange(self, x):
        g = self.group
        g.slots[self.rank] = x.detach().clone()
        g.barrier.wait()
        parts = list(g.slots)
        g.barrier.wait()  # nobody refills a slot before every rank has read them all
        return parts

    def _sum(self, x):
        parts = self._exchange(x)
        total = parts[0].clone()
        for t in parts[1:]:
            total += t
        return total

    def all_reduce(self, x):
        self.group.ops[self.rank].append("all_reduce")
        return x.copy_(self._sum(x))

    def all_gather(self, x, dim):
        self.group.ops[self.rank].append("all_gather")
        return torch.cat(self._exchange(x), dim=dim)

    def reduce_scatter(self, x, dim):
        self.group.ops[self.rank].append("reduce_scatter")
        assert x.shape[dim] % self.world_size == 0
        return self._sum(x).chunk(self.world_size, dim=dim)[self.rank].contiguous()

    def broadcast(self, x, src):
        self.group.ops[self.rank].append("broadcast")
        return x.copy_(self._exchange(x)[src])

    def send(self, x, dst):
        self.group.ops[self.rank].append("send")
        self.group.mail[(self.rank, dst)].put(x.detach().clone())

    def recv(self, shape, dtype, src, device="cpu"):
        self.group.ops[self.rank].append("recv")
        x = self.group.mail[(src, self.rank)].get(timeout=60)
        assert tuple(x.shape) == tuple(shape) and x.dtype == dtype, (x.shape, shape, x.dtype, dtype)
        return x


def full_logits_per_step(model, prompt, forced):
    """The single model's logits for the whole prompt, then for each forced token (KV-cached decode)."""
    kv = KVCache.for_model(model, 1, len(prompt) + len(forced) + 1)
    with torch.inference_mode():
        out = [model(torch.tensor([prompt]), kv_cache=kv)]
        out += [model(torch.tensor([[t]]), kv_cache=kv) for t in forced]
    return out


@pytest.mark.parametrize("p,heads,split", [(3, (6, 3), True), (2, (6, 3), False), (2, (4, 2), True),
                                           (4, (4, 2), False), (1, (6, 3), True)])
def test_tensor_parallel_shards_on_threads(p, heads, split):
    model = lively_model(n_heads=heads[0], n_kv_heads=heads[1])
    cfg, n_new = model.config, 6
    tokens = list(generate_ids(model, PROMPT, SamplingParams(max_tokens=n_new, temperature=0.0)))
    assert len(set(tokens)) > 1, "the lively model's tokens should vary"
    expected = full_logits_per_step(model, PROMPT, tokens)

    def rank(comm):
        shard = copy.deepcopy(model)
        plan = shard_tensor_parallel(shard, comm)
        b = shard.layers[0]
        shapes = (b.mlp.gate.weight.shape, b.mlp.down.weight.shape, b.attn.wq.weight.shape, b.attn.wo.weight.shape,
                  shard.embed.weight.shape, shard.config.ffn_dim, shard.config.n_kv_heads)
        return plan, shapes, full_logits_per_step(shard, PROMPT, tokens)

    group = _Threads(p)
    results = group.run(rank)
    hd = cfg.head_dim
    for r, (plan, shapes, logits) in enumerate(results):
        assert plan == TPPlan(p, split)
        q_out = cfg.n_heads // p * hd if split else cfg.n_heads * hd
        assert shapes == ((cfg.ffn_dim // p, cfg.dim), (cfg.dim, cfg.ffn_dim // p), (q_out, cfg.dim),
                          (cfg.dim, q_out), (cfg.vocab_size // p, cfg.dim), cfg.ffn_dim // p,
                          cfg.n_kv_heads // p if split else cfg.n_kv_heads)
        for step, (got, want) in enumerate(zip(logits, expected)):
            assert got.shape == want.shape
            assert max_diff(got, want) < tol(want), f"rank {r}, step {step}: {max_diff(got, want):.2e}"
    # per forward: the embedding's all-reduce, one per block per split region, the head's all-gather
    per_forward = ["all_reduce"] * (1 + cfg.n_layers * (2 if split else 1)) + ["all_gather"]
    assert group.ops[0] == per_forward * (1 + len(tokens))


@pytest.mark.parametrize("prompt_len", [12, 11, 2, 1])
def test_sequence_parallel_on_threads(prompt_len):
    # p = 3: a 12-token prompt runs fully split, 11 splits 9 and runs 2 as plain TP, 2 and 1 run as TP only
    model, p, n_new = lively_model(), 3, 5
    prompt = PROMPT[:prompt_len] + [PROMPT[0]] * max(0, prompt_len - len(PROMPT))
    tokens = list(generate_ids(model, prompt, SamplingParams(max_tokens=n_new, temperature=0.0)))
    expected = [e[:, -1:] for e in full_logits_per_step(model, prompt, tokens)]
    cfg = model.config

    def rank(comm):
        shard = copy.deepcopy(model)
        shard_tensor_parallel(shard, comm)
        enable_sequence_parallel(shard)
        widths = []  # tokens each block's residual input holds on this rank
        shard.layers[0].attn_norm.register_forward_pre_hook(lambda mod, args: widths.append(args[0].shape[1]))
        kv = KVCache.for_model(shard, 1, len(prompt) + n_new)
        out = [prefill_sp(shard, torch.tensor([prompt]), kv)]
        out += [sp_forward(shard, torch.tensor([[t]]), kv, last_only=True) for t in tokens]
        return out, widths, kv.seq_len

    group = _Threads(p)
    n_sp = prompt_len // p * p
    for r, (logits, widths, seq_len) in enumerate(group.run(rank)):
        assert seq_len == prompt_len + n_new
        chunks = [n_sp // p] if n_sp else []  # the split part holds s/p tokens per rank, the rest all of them
        chunks += [prompt_len - n_sp] if prompt_len - n_sp else []
        assert widths == chunks + [1] * n_new
        for step, (got, want) in enumerate(zip(logits, expected)):
            assert got.shape == want.shape == (1, 1, cfg.vocab_size)
            assert max_diff(got, want) < tol(want), f"rank {r}, step {step}: {max_diff(got, want):.2e}"
    ops = group.ops[0]
    regions = 2 * cfg.n_layers + 1  # every block's attention and MLP, and the embedding
    if n_sp:  # split: each region reduce-scatters, each block input and the final hidden states are all-gathered
        split_ops = ops[:2 * regions + 1]
        assert split_ops.count("reduce_scatter") == regions and split_ops.count("all_gather") == regions + 1
        assert "all_reduce" not in split_ops


def test_sequence_parallel_needs_split_attention():
    model = lively_model()  # 3 KV heads: replicated at tp = 2

    def rank(comm):
        shard = copy.deepcopy(model)
        shard_tensor_parallel(shard, comm)
        with pytest.raises(ValueError, match="attention split"):
            enable_sequence_parallel(shard)
        with pytest.raises(ValueError, match="shard_tensor_parallel first"):
            enable_sequence_parallel(copy.deepcopy(model))
        return True

    assert _Threads(2).run(rank) == [True, True]


@pytest.mark.parametrize("p,n_micro", [(2, 3), (3, 4), (3, 11), (4, 1)])
def test_pipeline_stages_on_threads(p, n_micro):
    model, n_new = lively_model(), 6
    tokens = list(generate_ids(model, PROMPT, SamplingParams(max_tokens=n_new, temperature=0.0)))
    expected = full_logits_per_step(model, PROMPT, tokens[:-1])

    def rank(comm):
        stage = PipelineStage(copy.deepcopy(model), comm, len(PROMPT) + n_new)
        kept = [not isinstance(b, torch.nn.Identity) for b in stage.model.layers]
        logits = [pipeline_prefill(stage, torch.tensor([PROMPT]), n_micro)]
        out = [stage.next_token(logits[-1])]
        while len(out) < n_new:
            logits.append(stage.forward(torch.tensor([[out[-1]]])))
            out.append(stage.next_token(logits[-1]))
        return out, logits, kept, stage.events

    group = _Threads(p)
    results = group.run(rank)
    bounds = stage_bounds(model.config.n_layers, p)
    for r, (out, logits, kept, events) in enumerate(results):
        assert out == tokens, f"stage {r}"
        assert kept == [bounds[r][0] <= i < bounds[r][1] for i in range(model.config.n_layers)]
        if r < p - 1:
            assert all(lg is None for lg in logits)
            assert group.ops[r].count("send") == n_micro + n_new - 1
        else:
            for step, (got, want) in enumerate(zip(logits, expected)):
                assert max_diff(got[0, -1], want[0, -1]) < tol(want), f"step {step}"
        assert [e[0] for e in events[:n_micro]] == list(range(n_micro))
    for r in range(1, p):  # stage r starts a micro-batch only after stage r - 1 has finished it
        for i in range(n_micro):
            assert results[r][3][i][1] >= results[r - 1][3][i][2]


def test_pipeline_refuses_more_micro_batches_than_tokens():
    model = lively_model()

    def rank(comm):
        stage = PipelineStage(copy.deepcopy(model), comm, 8)
        with pytest.raises(ValueError, match="micro-batches"):
            pipeline_prefill(stage, torch.tensor([PROMPT[:3]]), 4)
        return True

    assert _Threads(1).run(rank) == [True]


# ===================================================== 5. bad input: refused before any process starts (fast)


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if generate_parallel gets as far as starting ranks."""
    import minillm.parallel.distributed

    def refuse(*args, **kwargs):
        raise AssertionError("launch was called: the input should have been refused before any process started")

    monkeypatch.setattr(minillm.parallel.distributed, "launch", refuse)


@pytest.mark.parametrize("model,kwargs,match", [
    ({"tiny": TINY}, {"tp": 5}, "ffn_dim"),
    ({"tiny": {**TINY, "vocab_size": 385}}, {"tp": 3}, "vocab_size"),
    ({"tiny": TINY}, {"pp": 5}, "stages"),
    ({"tiny": TINY}, {"sp": True}, "tp >= 2"),
    ({"tiny": TINY}, {"tp": 2, "sp": True}, "attention split"),
    ({"tiny": TINY}, {"tp": 2, "pp": 2}, "not both"),
    ({"tiny": TINY}, {"tp": 0}, "tp must be"),
    ({"tiny": TINY}, {"pp": 2, "micro_batches": 0}, "micro_batches"),
    ({"tiny": TINY}, {"tp": 3, "params": SamplingParams(max_tokens=0)}, "request 0: max_tokens must be >= 1"),
    ({"tiny": TINY}, {"tp": 3, "params": SamplingParams(max_tokens=60)}, "64"),  # prompt + new past max_seq_len
])
def test_generate_parallel_refuses_before_starting(no_launch, model, kwargs, match):
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        generate_parallel(model, [PROMPT], **kwargs)
    assert time.perf_counter() - t0 < 5


def test_generate_parallel_refuses_text_for_a_tiny_model_and_an_empty_prompt(no_launch):
    with pytest.raises(ValueError, match="request 1: no tokenizer: pass the prompt as a list of token ids"):
        generate_parallel({"tiny": TINY}, [PROMPT, "hello"], SamplingParams(max_tokens=4), tp=3)
    with pytest.raises(ValueError, match="non-empty"):
        generate_parallel({"tiny": TINY}, [[]], tp=3)
    with pytest.raises(TypeError, match="list of prompts"):
        generate_parallel({"tiny": TINY}, PROMPT, tp=3)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        generate_parallel({"tiny": TINY}, [PROMPT], [SamplingParams(max_tokens=2)] * 2, tp=3)


def test_validate_accepts_what_runs():
    cfg = ModelConfig.tiny(**TINY)
    for pc in (ParallelConfig(tp=3, sp=True), ParallelConfig(tp=2), ParallelConfig(pp=4), ParallelConfig()):
        validate(cfg, pc)


@pytest.fixture
def solo_group():
    """A one-process gloo group in this process (no spawn), destroyed afterwards."""
    init_group(rank=0, world_size=1, port=free_port(), backend="gloo", timeout_s=30)
    try:
        yield Comm()
    finally:
        dist.destroy_process_group()


def test_one_rank_comm_counts_and_refusals(solo_group):
    comm = solo_group
    x = torch.ones(3, 5)
    assert comm.all_reduce(x) is x and comm.all_gather(x, 0).shape == (3, 5)
    assert comm.stats() == {"all_reduce": {"calls": 1, "bytes": 60, "ring_bytes": 0.0},
                            "all_gather": {"calls": 1, "bytes": 60, "ring_bytes": 0.0}}
    check_same_weights(lively_model(), comm)  # one rank always agrees with itself, and resets the counters
    assert comm.stats() == {} and comm.seconds == 0

    from minillm.compile.fusion import fuse, fuse_gate_up, fuse_norms, fuse_qkv
    from minillm.compress.quantize import quantize

    for rewrite in (fuse_qkv, fuse_gate_up, fuse_norms, fuse, lambda m: quantize(m, "int8")):
        with pytest.raises(ValueError, match="plain"):
            shard_tensor_parallel(rewrite(lively_model()), comm)
    untied = Transformer(ModelConfig.tiny(**TINY, tie_embeddings=False)).eval()
    with pytest.raises(ValueError, match="tied"):
        shard_tensor_parallel(untied, comm)

    # degree 1 is the model itself, with its (single-rank) collectives counted. 22 rows: up to 16 the model's CPU head
    # takes its few-row path (model.head_logits: W @ x.T, ~1e-5 apart from F.linear); past that both use F.linear
    model = lively_model()
    shard = copy.deepcopy(model)
    assert shard_tensor_parallel(shard, comm) == TPPlan(1, True)
    prompt = PROMPT * 2
    with torch.inference_mode():
        torch.testing.assert_close(shard(torch.tensor([prompt])), model(torch.tensor([prompt])), rtol=0, atol=0)
    assert comm.stats()["all_reduce"]["bytes"] == len(prompt) * tp_bytes_per_token(model.config, TPPlan(1, True))[
        "all_reduce"]


def test_weights_checksum_sees_any_change():
    a, b = lively_model(), lively_model()
    assert weights_checksum(a) == weights_checksum(b)
    with torch.no_grad():
        b.layers[2].mlp.down.weight[3, 4] += 1e-3
    assert weights_checksum(a) != weights_checksum(b)


def test_free_port_gives_distinct_usable_ports():
    ports = [free_port() for _ in range(4)]
    assert len(set(ports)) == len(ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
            s.listen()


# ============================================================ 3. real ranks (gloo) on tiny random models


def _suite(rank, world_size, cases, prompt, n_new):
    """Rank function: several generations in one process group (starting ranks is the expensive part).
    cases: (name, spec, ParallelConfig, expect_error); an expected RuntimeError is returned as its message."""
    import minillm.parallel.launch as par

    par.load_spec = lambda *a, **k: (_load_lively(*a, **k), None)
    out = {}
    for name, spec, cfg, expect_error in cases:
        request = (prompt, SamplingParams(max_tokens=n_new), frozenset())
        if expect_error:
            try:
                par.rank_generate(rank, world_size, spec, [request], cfg)
                out[name] = {"error": None}
            except RuntimeError as e:
                out[name] = {"error": str(e)}
        else:
            (out[name],) = par.rank_generate(rank, world_size, spec, [request], cfg)
    return out


def check_tp_decode_bytes(res, cfg, plan, p):
    """Measured decode traffic = decode steps x the per-token formula; ring bytes = the ring factor x bytes."""
    per_token = tp_bytes_per_token(cfg, plan)
    steps = res["decode_steps"]
    c = res["comm_decode"]
    assert steps == len(res["token_ids"]) - 1
    assert c["all_reduce"]["bytes"] == steps * per_token["all_reduce"]
    assert c["all_gather"]["bytes"] == steps * per_token["all_gather"]
    assert c["all_reduce"]["calls"] == steps * (1 + cfg.n_layers * (2 if plan.split_attention else 1))
    assert c["all_gather"]["calls"] == steps
    assert c["all_reduce"]["ring_bytes"] == pytest.approx(2 * (p - 1) / p * c["all_reduce"]["bytes"])
    assert c["all_gather"]["ring_bytes"] == pytest.approx((p - 1) / p * c["all_gather"]["bytes"])
    # the next token is broadcast once per generated token (8 bytes of int64)
    assert c["broadcast"] == {"calls": len(res["token_ids"]), "bytes": 8 * len(res["token_ids"]),
                              "ring_bytes": 8.0 * len(res["token_ids"])}


def sp_prefill_bytes(cfg, s, p):
    """Bytes handed to each collective by prefill_sp of s tokens on p ranks (last-position logits).

    The first n = s // p * p tokens run split: the embedding and the 2L regions each reduce-scatter (s x dim), the
    2L region inputs and the final hidden states are all-gathered (s x dim each), then the head's logits (one row,
    the vocabulary) are all-gathered. The remaining s - n tokens run as plain TP: 2L + 1 all-reduces of
    ((s - n) x dim) and the head's all-gather again."""
    n, regions, row = s // p * p, 2 * cfg.n_layers + 1, cfg.dim * F32
    out = {"reduce_scatter": regions * n * row, "all_gather": regions * n * row + cfg.vocab_size * F32,
           "all_reduce": 0}
    if n == 0:
        out = {"reduce_scatter": 0, "all_gather": 0, "all_reduce": 0}
    if s - n:
        out["all_reduce"] += regions * (s - n) * row
        out["all_gather"] += cfg.vocab_size * F32
    return {k: v for k, v in out.items() if v}


def ring_total(stats):
    return sum(v["ring_bytes"] for k, v in stats.items() if k in ("all_reduce", "all_gather", "reduce_scatter"))


# TINY speaking SmolLM2's vocabulary (49152 = 3 x 16384 splits over 3 ranks), with room for a chat template
TEXT_TINY = {"tiny": {**{k: v for k, v in TINY.items() if k != "vocab_size"}, "max_seq_len": 256}, "seed": 0,
             "tokenizer": "smollm2-135m"}


def test_generate_parallel_tp3_sp_tiny():
    # the public entry end to end: 3 gloo ranks, tensor + sequence parallel; one launch runs a 12-token prompt
    # (fully split), checked against the single process and the byte formulas, then two chat prompts with their
    # own params (one sampled, seeded), checked against LLM.generate: the same RequestOutputs
    from minillm.engine import LLM

    spec, prompt, n_new, p = TEXT_TINY, [(5 * i + 1) % 384 for i in range(12)], 6, 3
    prompts = [prompt, "The capital of France is", "Write a haiku about caches."]
    params = [SamplingParams(max_tokens=n_new, ignore_eos=True), SamplingParams(max_tokens=4, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0.8, seed=3, ignore_eos=True)]
    outs = generate_parallel(spec, prompts, params, tp=p, sp=True, chat=True, threads=1, timeout_s=60)
    assert all(type(o) is RequestOutput for o in outs)
    model, tok = load_spec(spec)
    want = LLM.from_model(model, tok).generate(prompts, params, chat=True)
    assert [(o.prompt_token_ids, o.token_ids, o.text, o.finish_reason) for o in outs] == [
        (o.prompt_token_ids, o.token_ids, o.text, o.finish_reason) for o in want]
    res = outs[0]
    with torch.inference_mode():
        logits = model(torch.tensor([prompt]))[0, -1]
    tokens = want[0].token_ids  # greedy, no stop: what reference() gives
    cfg, plan = model.config, TPPlan.for_config(model.config, p)
    assert res.token_ids == tokens and res.finish_reason == "length" and res.prompt_tokens == 12
    ranks = res.metrics["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    diffs = [f"{max_diff(r['first_logits'], logits):.1e}" for r in ranks]
    print(f"\ntp=3+sp first-logit max |diff| per rank: {diffs}")
    for r in ranks:
        assert r["token_ids"] == tokens
        assert max_diff(r["first_logits"], logits) < 1e-5, f"rank {r['rank']}: {max_diff(r['first_logits'], logits)}"
        check_tp_decode_bytes(r, cfg, plan, p)  # decode steps are one token: plain TP
        pre = r["comm_prefill"]
        assert {k: v["bytes"] for k, v in pre.items()} == sp_prefill_bytes(cfg, 12, p)
        assert pre["reduce_scatter"]["calls"] == 2 * cfg.n_layers + 1
        assert pre["all_gather"]["calls"] == 2 * cfg.n_layers + 2
        # an all-reduce is a reduce-scatter + an all-gather: split prefill moves exactly the ring bytes of plain TP
        # (2L + 1 all-reduces of s x dim, plus the logits' all-gather)
        tp_ring = (2 * (p - 1) / p * 12 * tp_bytes_per_token(cfg, plan)["all_reduce"]
                   + (p - 1) / p * cfg.vocab_size * F32)
        assert ring_total(pre) == pytest.approx(tp_ring)


def test_ranks_world2_tp_replicated_pp_and_mismatched_weights():
    # one launch of 2 ranks: tp=2 (attention replicated: 3 KV heads), pp=2 with 3 micro-batches, and ranks that
    # loaded different weights (refused by check_same_weights before any model collective)
    n_new, p = 8, 2
    cases = [("tp2", LIVELY, ParallelConfig(tp=2), False),
             ("pp2", LIVELY, ParallelConfig(pp=2, micro_batches=3), False),
             ("mismatch", {**LIVELY, "seed_per_rank": True}, ParallelConfig(tp=2), True)]
    ranks = launch(_suite, p, cases, PROMPT, n_new, timeout_s=60, threads=1, backend="gloo")
    tokens, logits, model = reference(LIVELY, PROMPT, n_new)
    cfg = model.config
    assert len(set(tokens)) > 1
    for rank, out in enumerate(ranks):
        tp = out["tp2"]
        assert tp["token_ids"] == tokens, f"tp=2 rank {rank}"
        assert max_diff(tp["first_logits"], logits) < tol(logits)
        check_tp_decode_bytes(tp, cfg, TPPlan(2, False), p)
        assert tp["comm_prefill"]["all_reduce"]["bytes"] == len(PROMPT) * (cfg.n_layers + 1) * cfg.dim * F32

        pp = out["pp2"]
        assert pp["token_ids"] == tokens, f"pp=2 rank {rank}"
        steps, c = pp["decode_steps"], pp["comm_decode"]
        if rank == 0:
            assert pp["first_logits"] is None
            assert c["send"] == {"calls": steps, "bytes": steps * cfg.dim * F32, "ring_bytes": steps * cfg.dim * F32}
            assert "recv" not in c
            assert pp["comm_prefill"]["send"]["calls"] == 3
            assert pp["comm_prefill"]["send"]["bytes"] == len(PROMPT) * cfg.dim * F32
        else:
            assert max_diff(pp["first_logits"], logits) < tol(logits)
            assert c["recv"]["calls"] == steps and "send" not in c
        assert c["broadcast"]["calls"] == n_new
        events = pp["events"]
        assert len(events) == p and [e[0] for e in events[rank][:3]] == [0, 1, 2]
        assert all(len(ev) == 3 + steps for ev in events)  # the prefill's micro-batches, then one per decode step
        for i in range(3):
            assert events[1][i][1] >= events[0][i][2]  # stage 1 waits for stage 0's micro-batch
        assert 0 <= measured_bubble([ev[:3] for ev in events]) < 1

        assert "different weights" in (out["mismatch"]["error"] or ""), out["mismatch"]


@pytest.mark.slow
def test_ranks_world3_tp_sp_pp():
    # one launch of 3 ranks: tp=3 (split attention), tp=3 + sp with an 11-token prompt (9 split + 2 plain TP), pp=3
    n_new, p = 8, 3
    cases = [("tp3", LIVELY, ParallelConfig(tp=3), False),
             ("sp3", LIVELY, ParallelConfig(tp=3, sp=True), False),
             ("pp3", LIVELY, ParallelConfig(pp=3, micro_batches=4), False)]
    ranks = launch(_suite, p, cases, PROMPT, n_new, timeout_s=60, threads=1, backend="gloo")
    tokens, logits, model = reference(LIVELY, PROMPT, n_new)
    cfg, plan = model.config, TPPlan(3, True)
    for rank, out in enumerate(ranks):
        for name in ("tp3", "sp3"):
            assert out[name]["token_ids"] == tokens, f"{name} rank {rank}"
            assert max_diff(out[name]["first_logits"], logits) < tol(logits)
            check_tp_decode_bytes(out[name], cfg, plan, p)
        assert out["tp3"]["comm_prefill"]["all_reduce"]["bytes"] == len(PROMPT) * tp_bytes_per_token(cfg, plan)[
            "all_reduce"]
        pre = out["sp3"]["comm_prefill"]
        assert {k: v["bytes"] for k, v in pre.items()} == sp_prefill_bytes(cfg, len(PROMPT), p)
        # the split 9 tokens move what TP would; the 2 leftover tokens run as TP; the first chunk's logits are
        # computed and gathered although only the last chunk's are used: one extra vocabulary all-gather
        tp_ring = ring_total(out["tp3"]["comm_prefill"])
        assert ring_total(pre) == pytest.approx(tp_ring + (p - 1) / p * cfg.vocab_size * F32)

        pp = out["pp3"]
        assert pp["token_ids"] == tokens, f"pp=3 rank {rank}"
        c = pp["comm_decode"]
        assert c.get("send", {}).get("calls", 0) == (pp["decode_steps"] if rank < p - 1 else 0)
        assert c.get("recv", {}).get("calls", 0) == (pp["decode_steps"] if rank > 0 else 0)
        if rank == p - 1:
            assert max_diff(pp["first_logits"], logits) < tol(logits)
    # per decode step, p - 1 hand-offs of one token's hidden state (1, 1, dim) fp32 in the whole pipeline
    steps = ranks[0]["pp3"]["decode_steps"]
    assert sum(o["pp3"]["comm_decode"].get("send", {}).get("bytes", 0) for o in ranks) == (
        steps * (p - 1) * cfg.dim * F32)


# ============================================================ 4. fail fast


def _stamp(path, name):
    with open(os.path.join(path, name), "w") as f:
        f.write(f"{os.getpid()} {time.time()}")


def _read_stamp(path, name):
    with open(os.path.join(path, name)) as f:
        pid, t = f.read().split()
    return int(pid), float(t)


def _fail_in_rank1(rank, world_size, path, how):
    """Rank 1 fails (how: "raise", "kill", "exit0") while rank 0 waits for it in a collective."""
    _stamp(path, f"rank{rank}")
    dist.barrier()  # both ranks are up before the failure
    if rank == 1:
        _stamp(path, "failed")
        if how == "raise":
            raise ValueError("boom")
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(0)  # leaves without a word: only the collective rank 0 waits in can notice
    dist.all_reduce(torch.ones(4))  # rank 1 never joins this one
    time.sleep(600)  # never reached when the failure is detected
    return "rank 0 was not stopped"


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, float(t)


def _our_rank_processes():
    import psutil

    alive = []
    for c in psutil.Process().children(recursive=True):
        try:
            if c.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(c.cmdline()):
                alive.append(c.pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _assert_gone(pids):
    import psutil

    for pid in pids:
        if psutil.pid_exists(pid):
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, f"rank process {pid} survived"
    assert _our_rank_processes() == []


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_failing_rank_stops_the_run_fast(tmp_path, how):
    # rank 1 raises ValueError("boom") / is SIGKILLed while rank 0 waits for it in an all-reduce: launch raises
    # within seconds (not after the group's timeout), no rank process survives, and the next launch works
    pytest.importorskip("psutil")
    with pytest.raises(RuntimeError) as err:
        launch(_fail_in_rank1, 2, str(tmp_path), how, timeout_s=10, threads=1, backend="gloo")
    done = time.time()
    msg = str(err.value)
    elapsed = done - _read_stamp(tmp_path, "failed")[1]
    print(f"\n[{how}] launch raised {elapsed:.2f} s after rank 1 failed: {msg.splitlines()[0]}")
    assert elapsed < 10, f"{elapsed:.1f} s: should not wait for the collective's timeout (10 s)"
    assert "of 2 failed, the others were stopped" in msg
    if how == "kill":  # dead at once, so its exit is seen first (which rank a *raise* is blamed on: see below)
        assert "rank 1 of 2" in msg and "SIGKILL" in msg, msg
    _assert_gone([_read_stamp(tmp_path, f"rank{r}")[0] for r in range(2)])
    if how == "raise":  # a new port, nothing left behind: the next launch works
        assert launch(_sum_ranks, 2, timeout_s=30, threads=1, backend="gloo") == [(0, 3.0), (1, 3.0)]


class _SlowToFormat(ValueError):
    def __str__(self):
        time.sleep(3)  # a long traceback, a loaded machine: the failing rank takes a moment to write its report
        return "boom"


def _raise_slowly_in_rank1(rank, world_size):
    dist.barrier()
    if rank == 1:
        raise _SlowToFormat()
    dist.all_reduce(torch.ones(4))  # rank 1 never joins
    time.sleep(600)


@pytest.mark.slow
def test_launch_names_the_rank_that_raised():
    with pytest.raises(RuntimeError) as err:
        launch(_raise_slowly_in_rank1, 2, timeout_s=10, threads=1, backend="gloo")
    assert "rank 1 of 2" in str(err.value) and "boom" in str(err.value), str(err.value)


@pytest.mark.slow
def test_rank_leaving_silently_is_caught_by_the_collective(tmp_path):
    # rank 1 exits with status 0 in the middle: no exception, no signal; rank 0's collective fails (the peer's
    # connection closed, or at the latest the group's timeout) and the run is stopped
    pytest.importorskip("psutil")
    with pytest.raises(RuntimeError) as err:
        launch(_fail_in_rank1, 2, str(tmp_path), "exit0", timeout_s=10, threads=1,
               backend="gloo")
    elapsed = time.time() - _read_stamp(tmp_path, "failed")[1]
    print(f"\n[exit0] launch raised {elapsed:.2f} s after rank 1 left; {str(err.value).splitlines()[0]}")
    assert "rank 0 of 2" in str(err.value)
    assert elapsed < 10 + 10
    _assert_gone([_read_stamp(tmp_path, f"rank{r}")[0] for r in range(2)])


def _quit_rank1(rank, world_size):
    if rank == 1:
        os._exit(0)  # a library calling exit(0), say: the rank is gone without a result
    return "rank 0's result"


@pytest.mark.slow
def test_launch_refuses_a_rank_that_left_without_a_result():
    with pytest.raises(RuntimeError, match="rank 1"):
        launch(_quit_rank1, 2, timeout_s=10, threads=1, backend="gloo")


# ============================================================ 6. SmolLM2-135M end to end


REAL_PROMPT = "The capital of France is"


def real_reference(real_model, n_new):
    from minillm import generate

    model, tok = real_model
    ids = tok.encode(REAL_PROMPT)
    with torch.inference_mode():
        logits = model(torch.tensor([ids]))[0, -1]
    return generate(model, tok, REAL_PROMPT, max_new_tokens=n_new, ignore_eos=True).token_ids, logits


def check_real(res, tokens, logits, last_rank_only):
    assert res.token_ids == tokens
    ranks = res.metrics["ranks"][-1:] if last_rank_only else res.metrics["ranks"]
    diffs = [max_diff(r["first_logits"], logits) for r in ranks]
    print(f"\nfirst-logit max |diff| per rank: {[f'{d:.2e}' for d in diffs]}")
    assert max(diffs) < 1e-4, diffs
    assert all(r["token_ids"] == tokens for r in res.metrics["ranks"])


@pytest.mark.slow  # ~100 s here: 3 ranks + this process each load the model
def test_real_model_smoke_tp3_sp(real_model):
    tokens, logits = real_reference(real_model, 8)
    (res,) = generate_parallel("smollm2-135m", [REAL_PROMPT], SamplingParams(max_tokens=8, ignore_eos=True), tp=3,
                               sp=True, timeout_s=300)
    check_real(res, tokens, logits, last_rank_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [{"tp": 3}, {"tp": 3, "sp": True}, {"pp": 2}, {"pp": 3}],
                         ids=["tp3", "tp3-sp", "pp2", "pp3"])
def test_real_model_matches_single_process(real_model, kwargs):
    tokens, logits = real_reference(real_model, 64)
    (res,) = generate_parallel("smollm2-135m", [REAL_PROMPT], SamplingParams(max_tokens=64, ignore_eos=True),
                               timeout_s=300, **kwargs)
    check_real(res, tokens, logits, last_rank_only="pp" in kwargs)
    assert res.text and res.finish_reason == "length"
    if "tp" in kwargs:
        cfg = real_model[0].config
        check_tp_decode_bytes({**res.metrics, "token_ids": res.token_ids}, cfg, TPPlan.for_config(cfg, 3), 3)




def test_launch_from_a_script_without_a_main_guard(tmp_path):
    """A lesson run as a script (`python lessons/11_parallelism.py`) has no `if __name__ == "__main__"` guard; the
    spawned ranks must not run the script again (they would try to start ranks of their own and die)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    script = tmp_path / "unguarded.py"
    script.write_text(f"import operator, sys\nsys.path.insert(0, {str(root)!r})\n"
                      "from minillm.parallel.distributed import launch\n"
                      "print('RESULT', launch(operator.add, 2, backend='gloo', threads=1, timeout_s=30))\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0 and "RESULT [2, 3]" in proc.stdout, proc.stderr[-2000:]
