"""The benchmark harness: time a function, probe the hardware, report a table of results with ratios vs targets.

Every technique in the course is judged the same way: the previous step and the next one are measured side by side
in one run (so a noisy machine slows both), and the claim is a ratio (speedup, memory saved) compared with a target.
Absolute numbers are only meaningful next to the hardware's own roofs, which `hardware_info` measures rather than
looks up: memory bandwidth from a large copy, peak FLOP/s from a large matmul. MBU (model bandwidth utilisation) and
MFU (model FLOP/s utilisation) divide what a run achieved by those roofs. Lesson 00 introduces both.

    from minillm.bench.harness import BenchResult, time_fn, hardware_info
    t = time_fn(lambda: model(ids), warmup=1, repeat=5)      # Timing: median/min/max seconds
    BenchResult(name="x", rows=[...], ratios={"speedup": 3.1}, targets={"speedup": (">=", 2.0)}).print_table()
"""

from __future__ import annotations

import json
import math
import operator
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

# --------------------------------------------------------------------------------------------------------- timing


@dataclass
class Timing:
    """Seconds per call over `repeat` timed runs (after warmup)."""

    median: float
    min: float
    max: float
    runs: list[float]

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the runs were (0.1 = 10%)."""
        return (self.max - self.min) / self.median if self.median > 0 else float("nan")

    def __str__(self) -> str:
        return f"{self.median * 1e3:.3f} ms (min {self.min * 1e3:.3f}, max {self.max * 1e3:.3f}, n={len(self.runs)})"


def _sync() -> None:
    # queued GPU kernels would otherwise finish after the clock stops
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def time_fn(fn: Callable[[], Any], warmup: int = 1, repeat: int = 5) -> Timing:
    """Call `fn` warmup times untimed, then `repeat` times timed; synchronizes CUDA around each call."""
    if repeat < 1 or warmup < 0:
        raise ValueError(f"need repeat >= 1 and warmup >= 0, got repeat={repeat}, warmup={warmup}")
    for _ in range(warmup):
        fn()
    runs = []
    for _ in range(repeat):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        runs.append(time.perf_counter() - t0)
    return Timing(median=statistics.median(runs), min=min(runs), max=max(runs), runs=runs)


# ------------------------------------------------------------------------------------------------------- hardware

_HARDWARE: dict[str, dict] = {}  # device type -> probe result, measured once per process


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _probe_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large tensor copy, counting the bytes read and the bytes written (best of a few runs)."""
    n_bytes = (1 << 30) if device.type == "cuda" else (128 << 20)  # far larger than any cache
    src = torch.ones(n_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), warmup=1, repeat=5)
    return 2 * n_bytes / t.min


def _probe_matmul(device: torch.device, dtype: torch.dtype) -> float | None:
    """FLOP/s of an n x n x n matmul (2 n^3 FLOPs), best of a few runs; None if the dtype is not supported."""
    n = 8192 if device.type == "cuda" else 2048  # CPU: 1024 reaches only ~2/3 of the 2048 rate
    try:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        t = time_fn(lambda: a @ b, warmup=2, repeat=6)  # best of six: one busy moment must not set the roof
    except (RuntimeError, TypeError):
        return None
    return 2 * n**3 / t.min


def hardware_info(device: str | torch.device = "cpu") -> dict:
    """Names, versions and *measured* roofs of `device` (cached per process: the probe takes ~1 s on a CPU).

    Keys: device, cpu, gpu, threads, torch, python, platform, bandwidth_GBps (copy, read+write bytes),
    flops_float32 and flops_bfloat16 (FLOP/s of a large matmul; None where unsupported).
    """
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("hardware_info(device='cuda') but torch sees no CUDA GPU; use device='cpu'")
    if dev.type not in _HARDWARE:
        bandwidth = _probe_bandwidth(dev)
        _HARDWARE[dev.type] = {
            "device": dev.type,
            "cpu": _cpu_name(),
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "bandwidth_GBps": bandwidth / 1e9,
            "flops_float32": _probe_matmul(dev, torch.float32),
            "flops_bfloat16": _probe_matmul(dev, torch.bfloat16),
        }
    return dict(_HARDWARE[dev.type])


def bandwidth(device: str | torch.device = "cpu") -> float:
    """Measured memory bandwidth of `device`, bytes/s."""
    return hardware_info(device)["bandwidth_GBps"] * 1e9


def peak_flops(dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu") -> float:
    """Measured matmul FLOP/s of `device` in `dtype` (float16 uses the bfloat16 probe; falls back to float32)."""
    name = str(dtype).replace("torch.", "")
    info = hardware_info(device)
    value = info.get(f"flops_{'bfloat16' if name == 'float16' else name}")
    return value if value else info["flops_float32"]


def hardware_summary(info: dict) -> str:
    """One line: what ran and its measured roofs."""
    name = info.get("gpu") or f"CPU {info.get('cpu')}, {info.get('threads')} threads"
    bf16 = info.get("flops_bfloat16")
    return (f"{name}; torch {info.get('torch')}; measured {info['bandwidth_GBps']:.1f} GB/s copy, "
            f"{info['flops_float32'] / 1e9:.0f} GFLOP/s fp32"
            + (f", {bf16 / 1e9:.0f} GFLOP/s bf16" if bf16 else ""))


# -------------------------------------------------------------------------------------------- inference metrics


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters, a tied tensor counted once (decode reads every weight once per step)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def decode_bytes_per_token(model, context_len: int, batch: int = 1) -> int:
    """Bytes a decode step must read from memory, per generated token: all weights (shared by the `batch`
    sequences of the step) plus each sequence's K and V for `context_len` cached tokens.

    This is the numerator of MBU; decode at batch 1 is memory-bound, so bytes/token / bandwidth bounds its speed.
    """
    from minillm.kv_cache import kv_bytes

    kv = kv_bytes(model.config, context_len, batch=batch, dtype=model.dtype)
    return (weight_bytes(model) + kv) // batch


def mbu(bytes_per_token: float, seconds_per_token: float, bandwidth: float) -> float:
    """Model bandwidth utilisation: achieved bytes/s over the measured bandwidth (bytes/s). 1.0 = at the roof."""
    return bytes_per_token / seconds_per_token / bandwidth


def mfu(flops: float, seconds: float, peak: float) -> float:
    """Model FLOP/s utilisation: achieved FLOP/s over the measured peak FLOP/s."""
    return flops / seconds / peak


def model_flops_per_token(cfg, context_len: int) -> int:
    """Forward FLOPs for one token that attends to `context_len` keys.

    2 FLOPs per weight per token for every matmul (the embedding lookup is no matmul; a tied LM head is), plus
    attention: q.k and p.v are 2 x 2 x n_heads x head_dim FLOPs per key per layer.
    """
    matmul_params = cfg.n_params() - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)
    attention = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * context_len
    return 2 * matmul_params + attention


def prefill_flops(cfg, n_tokens: int, logits_for: int | None = None) -> int:
    """FLOPs of a causal prefill of `n_tokens`: token i attends to i + 1 keys.

    `logits_for`: how many positions go through the LM head (default all n_tokens). A generation loop's prefill
    needs only the last one (`model(ids, last_only=True)`): with a 49,152-word vocabulary the head is a fifth of
    this model's weights, so counting it for every position would overstate the work (and MFU) by ~25%.
    """
    head = cfg.vocab_size * cfg.dim
    body = cfg.n_params() - head - (0 if cfg.tie_embeddings else head)  # minus the embedding lookup and the head
    keys = n_tokens * (n_tokens + 1) // 2
    logits_for = n_tokens if logits_for is None else logits_for
    return 2 * body * n_tokens + 2 * head * logits_for + 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * keys


def peak_memory(device: str | torch.device = "cpu") -> int:
    """Peak memory in bytes: the process's RSS high-water mark on CPU (never goes down), or the CUDA allocator's
    max_memory_allocated (reset it with torch.cuda.reset_peak_memory_stats() before the part you measure)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB, macOS bytes


# ------------------------------------------------------------------------------------------------------- results

_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


def check_target(value: float, target: tuple[str, float]) -> bool:
    op, bound = target
    if op not in _OPS:
        raise ValueError(f"target operator must be one of {list(_OPS)}, got {op!r}")
    return bool(_OPS[op](value, bound))


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if v == 0 or 1e-3 <= abs(v) < 1e6:
            return f"{v:.4g}" if abs(v) < 1000 else f"{v:.1f}"
        return f"{v:.3e}"
    return str(v)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    import numpy

    try:
        minillm_version = version("minillm")
    except PackageNotFoundError:  # running from a checkout that was never installed
        minillm_version = "unknown"
    return {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
            "minillm": minillm_version}


@dataclass
class BenchResult:
    """One benchmark's outcome: a table (rows), the claims (ratios) and what they should reach (targets)."""

    name: str
    rows: list[dict] = field(default_factory=list)
    ratios: dict[str, float] = field(default_factory=dict)
    targets: dict[str, tuple[str, float]] = field(default_factory=dict)  # ratio name -> (">=", 2.0)
    settings: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    hardware: dict | None = None  # filled from hardware_info(settings.get("device", "cpu")) when first needed
    quick: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.targets) - set(self.ratios)
        if unknown:
            raise ValueError(f"targets for ratios that were not reported: {sorted(unknown)}")
        for name, target in self.targets.items():
            if not (isinstance(target, (tuple, list)) and len(target) == 2 and target[0] in _OPS):
                raise ValueError(f"target {name!r} must be (op, value) with op in {list(_OPS)}, got {target!r}")

    def _hardware(self) -> dict:
        if self.hardware is None:
            self.hardware = hardware_info(self.settings.get("device", "cpu"))
        return self.hardware

    def status(self) -> dict[str, str]:
        """ratio name -> 'PASS' | 'MISS' | '-' (no target)."""
        return {k: ("-" if k not in self.targets else ("PASS" if check_target(v, self.targets[k]) else "MISS"))
                for k, v in self.ratios.items()}

    @property
    def passed(self) -> bool:
        return all(s != "MISS" for s in self.status().values())

    def table(self) -> str:
        """The rows as an aligned text table (columns in order of first appearance)."""
        if not self.rows:
            return "(no rows)"
        cols: list[str] = []
        for row in self.rows:
            cols += [c for c in row if c not in cols]
        cells = [[_fmt(row.get(c, "")) for c in cols] for row in self.rows]
        widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
        numeric = [all(isinstance(row.get(c), (int, float)) for row in self.rows if c in row) for c in cols]

        def line(vals: list[str]) -> str:
            return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric)).rstrip()

        return "\n".join([line(cols), line(["-" * w for w in widths]), *map(line, cells)])

    def print_table(self) -> None:
        print(f"== {self.name}{' [quick]' if self.quick else ''} on {hardware_summary(self._hardware())}")
        if self.settings:
            print("settings: " + ", ".join(f"{k}={v}" for k, v in self.settings.items()))
        print(self.table())
        status = self.status()
        if self.ratios:
            width = max(map(len, self.ratios))
            for k, v in self.ratios.items():
                target = f"target {self.targets[k][0]} {_fmt(float(self.targets[k][1]))}" if k in self.targets \
                    else "no target"
                print(f"  {k:<{width}s} = {_fmt(float(v)):>9s}   ({target})  {status[k]}")
        for note in self.notes:
            print(f"  note: {note}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["hardware"] = self._hardware()
        d["versions"] = _versions()
        d["timestamp"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        d["status"] = self.status()
        return d

    def save(self, dir: str | os.PathLike = "results") -> Path:
        """Write <dir>/<name>.json (rows, ratios, targets, status, settings, hardware, versions, timestamp, quick)."""
        out = Path(dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{self.name}.json"
        path.write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        self._saved_dir = out
        return path

    def plot(self, x: str, y: str | list[str], series: str | None = None, path: str | os.PathLike | None = None,
             logy: bool = False, title: str | None = None, xlabel: str | None = None, ylabel: str | None = None):
        """Line plot of rows' `y` (one column or several) against `x`, one line per value of `series`.

        Saves a PNG (default: next to the JSON, <dir>/<name>.png) and returns the figure.
        """
        import matplotlib.pyplot as plt

        ys = [y] if isinstance(y, str) else list(y)
        missing = [c for c in [x, *ys, *([series] if series else [])] if not any(c in r for r in self.rows)]
        if missing:
            raise ValueError(f"no row has column(s) {missing}; columns: {sorted({k for r in self.rows for k in r})}")
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        groups: dict[Any, list[dict]] = {}
        for row in self.rows:
            groups.setdefault(row.get(series) if series else None, []).append(row)
        for key, rows in groups.items():
            for col in ys:
                pts = sorted((r[x], r[col]) for r in rows if x in r and col in r and r[col] is not None)
                if not pts:
                    continue
                label = " ".join(str(s) for s in (key if series else None, col if len(ys) > 1 or not series else None)
                                 if s is not None)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label or col)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel or x)
        ax.set_ylabel(ylabel or (ys[0] if len(ys) == 1 else "value"))
        ax.set_title(title or f"{self.name}: {', '.join(ys)} vs {x}")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        out = Path(path) if path else Path(getattr(self, "_saved_dir", "results")) / f"{self.name}.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
        return fig
