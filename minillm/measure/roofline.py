"""A roofline model of one forward step: which way should an optimisation move the time, here and on a GPU?

    CPU:  seconds ~= max(bytes / bandwidth, FLOPs / FLOP/s) + ops x seconds per op
    GPU:  seconds ~= max(bytes / bandwidth, FLOPs / FLOP/s, ops x seconds per launch)

The first two terms are lesson 00's roofline; the third, a fixed cost per op, is what a small model meets first. The
model is for the *sign* and rough size of a change: which term dominates decides what an optimisation can buy.
Lessons 01 and 05-08 and 12 use it in their "roofline model" cells; the terms and their sources: `Machine`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.measure.metrics import model_flops_per_token


@dataclass(frozen=True)
class Step:
    """What one forward step asks of a machine: bytes read from memory, FLOPs, ops dispatched."""

    bytes: float
    flops: float
    ops: int = 0


@dataclass(frozen=True)
class Machine:
    """A machine as the model sees it: three roofs and where they come from.

    The max of the memory and compute terms is lesson 00's roofline: a step waits for its bytes or for its arithmetic,
    whichever takes longer. The ops term is what a small model meets first: every op costs a fixed time whatever its
    size (Python and torch's dispatcher on a CPU, a kernel launch on a GPU). On a CPU the same core dispatches and
    computes, so the op cost adds; a GPU runs kernels while the CPU queues the next launches, so the slower of the
    two sets the pace (`overlaps_ops`).

    `this_cpu()` measures the three numbers here: hardware_info's copy bandwidth and matmul FLOP/s (lesson 00), and
    `probe_op_seconds`, the time of an op too small to do any work. `H100_SXM` states datasheet figures instead.
    """

    name: str
    bandwidth: float  # bytes/s
    flops: float  # FLOP/s of a large matmul, in the dtype the step computes in
    op_seconds: float  # fixed cost of one op: dispatch on a CPU, a kernel launch on a GPU
    bytes_per_weight: float  # the dtype the model reads its weights in here (4: float32, 2: bf16)
    overlaps_ops: bool  # True on a GPU: launches queue while earlier kernels run
    source: str  # "measured here" or the datasheet figures

    def terms(self, step: Step) -> dict[str, float]:
        """Seconds each roof alone would take: memory, compute, and the ops' fixed cost."""
        return {"memory": step.bytes / self.bandwidth, "compute": step.flops / self.flops,
                "ops": step.ops * self.op_seconds}

    def seconds(self, step: Step) -> float:
        t = self.terms(step)
        if self.overlaps_ops:
            return max(t.values())
        return max(t["memory"], t["compute"]) + t["ops"]

    def bound(self, step: Step) -> str:
        """The term that sets the step's time: 'memory', 'compute' or 'ops'."""
        t = self.terms(step)
        return max(t, key=t.get)


# datasheet figures: NVIDIA H100 SXM5, dense bf16 tensor-core FLOP/s (the sparse figure is twice that, lesson 08);
# the launch cost is a typical figure for a kernel launched from eager PyTorch, not a datasheet one. Whatever is
# computed for it is a model, not a measurement: real kernels reach a fraction of each roof (lesson 06 measures how
# much of it torch reaches here).
H100_SXM = Machine(name="H100 SXM (model)", bandwidth=3.35e12, flops=989e12, op_seconds=5e-6, bytes_per_weight=2,
                   overlaps_ops=True,
                   source="datasheet: 3.35 TB/s HBM3, 989 TFLOP/s dense bf16; ~5 us per kernel launch; bf16 weights")


def probe_op_seconds(device: str = "cpu", calls: int = 500, rounds: int = 5) -> float:
    """Seconds of one op that does almost no work (a multiply of two 576-wide rows, as a decode step has hundreds
    of): the fixed cost every eager op pays, Python call included. Best of `rounds`, a few ms in all."""
    from minillm.measure.metrics import timer

    a, b = torch.randn(1, 576, device=device), torch.randn(1, 576, device=device)
    best = float("inf")
    for _ in range(rounds):
        with timer() as t:
            for _ in range(calls):
                torch.mul(a, b)
        best = min(best, t.seconds / calls)
    return best


def eager_ops(model) -> int:
    """Aten ops one eager batch-1 decode step of `model` dispatches (minillm.compile.fusion.count_ops, lesson 06)."""
    from minillm.compile.fusion import count_ops
    from minillm.kv_cache import KVCache

    cache = KVCache.for_model(model, 1, 2)
    with torch.inference_mode():
        model(torch.tensor([[1]], device=model.device), kv_cache=cache)
    return count_ops(model, torch.tensor([[2]], device=model.device), kv_cache=cache)


def this_cpu(dtype: torch.dtype = torch.float32) -> Machine:
    """This CPU, measured: hardware_info's copy bandwidth and matmul FLOP/s in `dtype`, and the per-op cost."""
    from minillm.measure.hardware import hardware_info

    info = hardware_info("cpu")
    name = str(dtype).replace("torch.", "")
    flops = info.get(f"flops_{name}") or info["flops_float32"]
    return Machine(name=f"this CPU ({info['cpu']}, {info['threads']} thr.)", bandwidth=info["bandwidth_GBps"] * 1e9,
                   flops=flops, op_seconds=probe_op_seconds(), bytes_per_weight=torch.finfo(dtype).bits / 8,
                   overlaps_ops=False,
                   source=f"measured here: {info['bandwidth_GBps']:.1f} GB/s copy, {flops / 1e9:.0f} GFLOP/s {name}")


def forward_step(cfg, machine: Machine, tokens: int = 1, context: int = 0, batch: int = 1, ops: int = 0,
                 weight_scale: float = 1.0, matmul_flop_scale: float = 1.0) -> Step:
    """One forward of `batch` sequences, each with `tokens` new tokens attending to `context` keys (a prefill of T
    tokens: about T/2 on average): the weights are read once (a tied LM head is the embedding; an untied embedding
    is only looked up), K and V of the context once per sequence, in the machine's weight dtype. `weight_scale`
    scales the weight bytes (0.5: int8 in place of bf16), `matmul_flop_scale` the matmul FLOPs (0.5: a sparse core
    that skips half of them)."""
    read_params = cfg.n_params() - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * context * batch * machine.bytes_per_weight
    matmul = 2 * read_params * tokens * batch
    attention = (model_flops_per_token(cfg, context) - 2 * read_params) * tokens * batch
    return Step(bytes=read_params * machine.bytes_per_weight * weight_scale + kv,
                flops=matmul * matmul_flop_scale + attention, ops=ops)


def table(cases: dict[str, tuple[Step, Step]], machine: Machine) -> list[dict]:
    """For each case, (before, after) on one machine: the model's seconds, the speedup it predicts, and what binds
    each side. A row per case."""
    rows = []
    for label, (before, after) in cases.items():
        t0, t1 = machine.seconds(before), machine.seconds(after)
        rows.append({"machine": machine.name, "case": label, "before_ms": t0 * 1e3, "after_ms": t1 * 1e3,
                     "speedup": t0 / t1, "bound_before": machine.bound(before), "bound_after": machine.bound(after)})
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'machine':<34}{'case':<38}{'before ms':>10}{'after ms':>10}{'speedup':>9}  bound (before -> after)")
    for r in rows:
        print(f"{r['machine'][:33]:<34}{r['case'][:37]:<38}{r['before_ms']:>10.3f}{r['after_ms']:>10.3f}"
              f"{r['speedup']:>8.2f}x  {r['bound_before']} -> {r['bound_after']}")
