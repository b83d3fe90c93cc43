"""Where one step's time goes: weight matmuls, attention, elementwise ops, sampling, and Python/dispatch.

`step_breakdown(model, "decode" | "verify" | "batch")` times one step of that kind, un-profiled for its wall time and
under torch.profiler for its ops, and returns a `Breakdown`: each term in ms and as a share of the wall, the op
count, and the byte and compute floors the step could reach on this machine. `breakdown_of(step)` does the same
for any step a caller builds (an engine step, a fused model); mark its sampling with `sampling_scope()`.

    print(step_breakdown(model, "decode", context=256).line())   # decode b=1: <wall> ms; matmul <ms> (<share>); ...
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from minillm.compile.native import HEAD_SCOPE as NATIVE_HEAD
from minillm.compile.native import SCOPE as NATIVE_SCOPE
from minillm.compile.native import STAGE_SECONDS
from minillm.measure.metrics import model_flops_per_token, timer
from minillm.sampling import argmax_rows

KINDS = ("decode", "verify", "batch")
TERMS = ("matmul", "attention", "elementwise", "sampling", "else")

# op name -> term, for ops outside an attention or sampling scope; any other op counts as "elementwise" (norms,
# RoPE, activations, residual adds, KV-cache writes, views, the embedding gather)
OP_TERMS: dict[str, str] = {
    **dict.fromkeys(("aten::linear", "aten::matmul", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
                     "aten::mv", "aten::addmv", "aten::einsum", "aten::_weight_int8pack_mm",
                     "aten::_weight_int4pack_mm", "minillm::q4_1_matmul", "minillm::int8_matmul"), "matmul"),
    **dict.fromkeys(("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
                     "aten::_scaled_dot_product_attention_math", "aten::_scaled_dot_product_flash_attention",
                     "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention"),
                    "attention"),
}
_STEP, _ATTENTION, _SAMPLING = "minillm::step", "minillm::attention", "minillm::sampling"
_SCOPES = {_ATTENTION: "attention", _SAMPLING: "sampling"}
# the CPU low-bit kernels are called straight from Python (pybind, no dispatcher: the profiler records no op), so a
# scope of this name stands for the call and is charged like an op: classify() sends it to "matmul"
_KERNEL_MATMUL = "minillm::kernel_matmul"


def classify(name: str) -> str:
    """The term an op outside any scope is charged to, from its profiler name (e.g. 'aten::mm' -> 'matmul')."""
    if name in OP_TERMS:
        return OP_TERMS[name]
    if name.startswith("minillm::"):  # custom kernels registered later: paged/int8 attention, low-bit matmuls
        if "attention" in name or "paged" in name:
            return "attention"
        if "matmul" in name:
            return "matmul"
    return "elementwise"


def sampling_scope() -> contextlib.AbstractContextManager:
    """Wrap a step's sampling in this: every op inside it is charged to 'sampling'."""
    return record_function(_SAMPLING)


@contextlib.contextmanager
def attention_scope(model: Any) -> Iterator[None]:
    """While inside, the model's attention backend runs in a profiler scope, so the ops it calls (a causal mask, a
    naive backend's matmuls) count as attention. A model without minillm's backend seam is left as it is."""
    original = getattr(model, "_attn", None)
    if original is None:
        yield
        return

    def scoped(*args, **kwargs):
        with record_function(_ATTENTION):
            return original(*args, **kwargs)

    model._attn = scoped
    try:
        yield
    finally:
        model._attn = original


@contextlib.contextmanager
def kernel_matmul_scope() -> Iterator[None]:
    """While inside, every quantized layer's CPU-kernel matmul runs in a profiler scope charged to 'matmul'."""
    from minillm.compress.quant import QuantizedLinear

    original = QuantizedLinear._kernel_matmul

    def scoped(self, *args, **kwargs):
        with record_function(_KERNEL_MATMUL):
            return original(self, *args, **kwargs)

    QuantizedLinear._kernel_matmul = scoped
    try:
        yield
    finally:
        QuantizedLinear._kernel_matmul = original


@dataclass
class Breakdown:
    """One step's wall time split into TERMS (ms), with the floors it is held to (ms; None where not given)."""

    label: str
    wall_ms: float
    terms: dict[str, float]
    n_ops: int
    byte_floor_ms: float | None = None
    compute_floor_ms: float | None = None
    profiled_wall_ms: float = float("nan")  # the same step under the profiler: its overhead is the gap to wall_ms
    op_counts: dict[str, int] = field(default_factory=dict)
    settings: dict = field(default_factory=dict)

    @property
    def shares(self) -> dict[str, float]:
        """Each term as a fraction of the wall time; they sum to 1."""
        return {k: v / self.wall_ms if self.wall_ms > 0 else 0.0 for k, v in self.terms.items()}

    @property
    def floor_ms(self) -> float | None:
        """The roofline floor: the larger of the byte and compute floors."""
        floors = [f for f in (self.byte_floor_ms, self.compute_floor_ms) if f is not None]
        return max(floors) if floors else None

    def largest(self) -> str:
        """The term that took the most time."""
        return max(self.terms, key=self.terms.get)

    def gap(self) -> dict[str, float]:
        """The time above the byte floor, by term (ms): the matmuls' time past the floor (they stream the weights,
        most of the bytes) and every other term whole; the values sum to wall - byte floor."""
        if self.byte_floor_ms is None:
            raise ValueError(f"{self.label} has no byte floor: pass bytes_read and bandwidth")
        return {k: v - self.byte_floor_ms if k == "matmul" else v for k, v in self.terms.items()}

    def gap_line(self) -> str:
        """One sentence that explains the step's distance from its byte floor with this run's own terms."""
        gap, total = self.gap(), self.wall_ms - self.byte_floor_ms
        parts = ", ".join(f"{'matmul above the floor' if k == 'matmul' else k} {v:.1f} ms ({v / total:.0%})"
                          for k, v in sorted(gap.items(), key=lambda kv: -kv[1]))
        return (f"{self.label}: {self.wall_ms:.1f} ms vs a byte floor of {self.byte_floor_ms:.1f} ms; the "
                f"{total:.1f} ms gap is {parts}; largest: {max(gap, key=gap.get)}")

    def line(self) -> str:
        """One line: the wall, each term in ms and share, the op count, the floors (bytes, compute)."""
        parts = ", ".join(f"{k} {v:.2f} ms ({self.shares[k]:.0%})" for k, v in self.terms.items())
        floor = "" if self.floor_ms is None else "; floor " + " / ".join(
            f"{v:.2f} ms ({name})" for name, v in (("bytes", self.byte_floor_ms), ("compute", self.compute_floor_ms))
            if v is not None)
        return f"{self.label}: {self.wall_ms:.2f} ms; {parts}; {self.n_ops} ops{floor}"

    def table(self) -> str:
        """A term per line (ms, share, ops), then the floors as fractions of the wall."""
        rows = [f"{self.label}: {self.wall_ms:.3f} ms per step (profiled: {self.profiled_wall_ms:.3f} ms)",
                f"  {'term':<12}{'ms':>9}{'share':>8}{'ops':>7}"]
        rows += [f"  {k:<12}{v:>9.3f}{self.shares[k]:>8.1%}{self.op_counts.get(k, ''):>7}" for k, v in
                 self.terms.items()]
        for name, v in (("byte floor", self.byte_floor_ms), ("compute floor", self.compute_floor_ms)):
            if v is not None:
                rows.append(f"  {name:<12}{v:>9.3f}{v / self.wall_ms:>8.1%}  of the wall")
        return "\n".join(rows)

    def as_row(self) -> dict:
        """Flat columns for a BenchResult row: wall, each term in ms and share, ops, floors."""
        row: dict[str, Any] = {"step": self.label, "wall_ms": self.wall_ms}
        row |= {f"{k}_ms": v for k, v in self.terms.items()}
        row |= {f"{k}_share": v for k, v in self.shares.items()}
        return row | {"ops": self.n_ops, "byte_floor_ms": self.byte_floor_ms, "compute_floor_ms": self.compute_floor_ms,
                      "profiled_ms": self.profiled_wall_ms}


def _is_scope(ev) -> bool:
    # record_function scopes (ours or a caller's) are annotations, not ops; older torch lacks the flag
    if ev.name in (_KERNEL_MATMUL, NATIVE_SCOPE, NATIVE_HEAD, _SAMPLING):  # charged as one op: sampling may run no op
        return False  # (a greedy pick is numpy's argmax, sampling.argmax_rows)
    return bool(getattr(ev, "is_user_annotation", False)) or ev.name in _SCOPES or ev.name == _STEP


def _charge(events) -> tuple[dict[str, float], dict[str, int], float]:
    """Per-term op time (us) and op counts of the profiled steps' events, and the steps' summed time (us).

    An op is charged once, with its inclusive time, at its outermost level: aten::linear's inner aten::mm is inside
    it. An op under an attention or sampling scope goes to that scope's term whatever its name; ops outside any
    minillm::step scope (the profiler's own, a reset between steps) are left out."""
    times, counts, step_us = dict.fromkeys((*TERMS[:-1], "native"), 0.0), dict.fromkeys(TERMS[:-1], 0), 0.0
    for ev in events:
        if ev.name == _STEP:
            step_us += ev.cpu_time_total
        if _is_scope(ev) or (ev.cpu_parent is not None and not _is_scope(ev.cpu_parent)):
            continue  # a scope, or an op inside another op (already in that op's inclusive time)
        parent, scope, in_step = ev.cpu_parent, None, False
        while parent is not None:
            scope = scope or _SCOPES.get(parent.name)
            in_step = in_step or parent.name == _STEP
            parent = parent.cpu_parent
        if in_step and ev.name == NATIVE_SCOPE:  # every layer in one C++ call: split later, by its own clock
            times["native"] += ev.cpu_time_total
        elif in_step:
            term = scope or _SCOPES.get(ev.name) or classify(ev.name)
            times[term] += ev.cpu_time_total
            counts[term] += 1
    return times, counts, step_us


def _floor_ms(amount: float | None, rate: float | None) -> float | None:
    return None if amount is None or not rate else amount / rate * 1e3


def breakdown_of(step: Callable[[], Any], reset: Callable[[], Any] | None = None, repeat: int = 5, warmup: int = 1,
                 profile_repeat: int | None = None, label: str = "step", bytes_read: float | None = None,
                 flops: float | None = None, bandwidth: float | None = None, flops_per_s: float | None = None,
                 settings: dict | None = None) -> Breakdown:
    """Break down `step()` (one step; `reset()` runs untimed after each, e.g. rolling a cache back).

    The wall time is the median of `repeat` un-profiled calls. The split comes from `profile_repeat` (default
    min(repeat, 3)) calls under torch.profiler (CPU activity), summed: each op term is the inclusive time of the ops
    charged to it (see `_charge`), and "else" = the profiled steps' time - all their ops' time: Python between ops,
    module calls, dispatch outside an op's recorded interval. The terms are then scaled by wall / profiled time, so
    they sum to the un-profiled wall and keep the profiled step's proportions (both taken from the same steps, a
    noisy moment between the two runs cannot make "else" negative). Caveat: the profiler's own per-op cost lands
    partly inside ops, partly between them; `profiled_wall_ms` shows how much it added. The floors are
    bytes_read / bandwidth and flops / flops_per_s, given only where both numbers are. A CPU tool: on a GPU the CPU
    activity it profiles is the kernels' launch, not their run."""
    if repeat < 1 or warmup < 0 or (profile_repeat is not None and profile_repeat < 1):
        raise ValueError(f"need repeat >= 1, warmup >= 0 and profile_repeat >= 1 (or None), got repeat={repeat}, "
                         f"warmup={warmup}, profile_repeat={profile_repeat}")
    reset = reset or (lambda: None)
    for _ in range(warmup):
        step()
        reset()
    with kernel_matmul_scope():
        return _breakdown(step, reset, repeat, n=profile_repeat if profile_repeat is not None else min(repeat, 3),
                          label=label, bytes_read=bytes_read, flops=flops, bandwidth=bandwidth,
                          flops_per_s=flops_per_s, settings=settings)


def _breakdown(step, reset, repeat, n, label, bytes_read, flops, bandwidth, flops_per_s, settings) -> Breakdown:
    walls = []
    for _ in range(repeat):
        with timer() as t:
            step()
        walls.append(t.seconds * 1e3)
        reset()
    wall = statistics.median(walls)
    before = dict(STAGE_SECONDS)
    with _no_native_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            with record_function(_STEP):
                step()
            reset()
    times, counts, step_us = _charge(prof.events())
    profiled = step_us / n / 1e3
    split = {k: v / n / 1e3 for k, v in times.items()}
    native = split.pop("native")
    inside = {k: STAGE_SECONDS[k] - before[k] for k in STAGE_SECONDS}
    if native > 0 and inside["total"] > 0:  # the native call's own clock: its stages, the rest left to "else"
        for stage, term in (("matmul", "matmul"), ("attention", "attention"), ("pointwise", "elementwise")):
            split[term] += native * inside[stage] / inside["total"]
    split["else"] = max(0.0, profiled - sum(split.values()))
    total = sum(split.values())
    if total <= 0:  # a step too short for the profiler's clock: all of it is "else"
        split, total = {**dict.fromkeys(split, 0.0), "else": 1.0}, 1.0
    terms = {k: v * wall / total for k, v in split.items()}
    return Breakdown(label=label, wall_ms=wall, terms=terms, n_ops=round(sum(counts.values()) / n),
                     byte_floor_ms=_floor_ms(bytes_read, bandwidth),
                     compute_floor_ms=_floor_ms(flops, flops_per_s),
                     profiled_wall_ms=profiled, op_counts={k: round(v / n) for k, v in counts.items()},
                     settings=dict(settings or {}))


@contextlib.contextmanager
def _no_native_stderr() -> Iterator[None]:
    """torch's CPU build writes two trace lines (USDT profiler_start / profiler_stop) to file descriptor 2 around
    every profile: noise in a lesson's output. fd 2 points at /dev/null while the profiler starts and stops."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved), os.close(devnull)


def step_breakdown(model: torch.nn.Module, kind: str = "decode", batch: int = 1, k: int = 4, context: int = 128,
                   repeat: int = 5, warmup: int = 1, profile_repeat: int | None = None,
                   bandwidth: float | None = None, flops_per_s: float | None = None,
                   kv_dtype: torch.dtype | None = None) -> Breakdown:
    """Break down one step of minillm `model` after `context` cached tokens (greedy sampling included):

      decode  1 sequence, 1 new token                     (a generate() step)
      verify  `batch` sequences, 1 + k new tokens each    (a speculative verify step over k drafts, all logits)
      batch   `batch` sequences, 1 new token each         (a batched decode step, on the contiguous cache)

    The cache holds `context` random keys and values per sequence (a step's cost depends on how many, not on what
    they are; kv_dtype=torch.int8 for lesson 07's int8 cache) and is rolled back after each step. Floors: the weights
    plus the K/V the step reads over `bandwidth` (default: hardware.bandwidth, a copy rate counting read and written
    bytes, as MBU does), and the forward's FLOPs over `flops_per_s` (default: hardware.peak_flops, the matmul rate
    every lesson divides by)."""
    from minillm.kv_cache import Int8KVCache, KVCache
    from minillm.model import model_bytes

    if kind not in KINDS:
        raise ValueError(f"unknown step kind {kind!r}; choose one of {', '.join(KINDS)}")
    if batch < 1 or k < 1 or context < 0:
        raise ValueError(f"need batch >= 1, k >= 1 and context >= 0, got batch={batch}, k={k}, context={context}")
    if kind == "decode" and batch != 1:
        raise ValueError(f"kind='decode' is the batch-1 step; for {batch} sequences use kind='batch'")
    cfg, device = model.config, model.device
    n_new = 1 + k if kind == "verify" else 1
    if context + n_new > cfg.max_seq_len:
        raise ValueError(f"context {context} + {n_new} new tokens is past the context window ({cfg.max_seq_len})")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, n_new), generator=g).to(device)
    kv = (Int8KVCache if kv_dtype == torch.int8 else KVCache).for_model(model, batch, context + n_new, kv_dtype)
    if kv.k.dtype == torch.int8:
        kv.k.random_(-127, 128), kv.v.random_(-127, 128), kv.k_scale.fill_(0.02), kv.v_scale.fill_(0.02)
    else:
        kv.k.normal_(), kv.v.normal_()
    kv.seq_len = context

    def step() -> list:
        logits = model(ids, kv_cache=kv)
        with sampling_scope():
            return argmax_rows(logits).tolist()  # as generate() picks a greedy token

    if bandwidth is None:
        from minillm.measure.hardware import bandwidth as measured_bandwidth

        bandwidth = measured_bandwidth(device)
    if flops_per_s is None:
        from minillm.measure.hardware import peak_flops

        flops_per_s = peak_flops(model.dtype, device)
    bytes_read = model_bytes(model) + kv.nbytes()  # the cache holds exactly the tokens the step attends over
    flops = batch * sum(model_flops_per_token(cfg, context + i + 1) for i in range(n_new))
    label = {"decode": "decode b=1", "verify": f"verify k={k}" + (f" b={batch}" if batch > 1 else ""),
             "batch": f"batch {batch}"}[kind]
    settings = {"kind": kind, "batch": batch, "k": k if kind == "verify" else None, "context": context,
                "new_tokens": n_new, "dtype": str(model.dtype).replace("torch.", ""), "repeat": repeat,
                "kv_dtype": str(kv.k.dtype).replace("torch.", ""), "kv_bytes": kv.nbytes(), "bytes_read": bytes_read}
    with torch.inference_mode(), attention_scope(model):
        return breakdown_of(step, lambda: kv.truncate(context), repeat=repeat, warmup=warmup,
                            profile_repeat=profile_repeat, label=label, bytes_read=bytes_read, flops=flops,
                            bandwidth=bandwidth, flops_per_s=flops_per_s, settings=settings)
