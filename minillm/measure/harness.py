"""The benchmark harness: time a function, report a table of results with ratios vs targets (every bench).

Every technique is judged the same way: the previous step and the next measured side by side in one run (a
noisy machine slows both), the claim a ratio compared with a target. The roofs: minillm.measure.hardware; MBU,
MFU and the timer: minillm.measure.metrics.

    t = time_fn(lambda: model(ids), warmup=1, repeat=5)      # Timing: median/min/max seconds
    BenchResult(name="x", rows=[...], ratios={"speedup": 3.1}, targets={"speedup": (">=", 2.0)}).print_table()
"""

from __future__ import annotations

import json
import math
import operator
import os
import platform
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from minillm.measure.hardware import hardware_info, hardware_summary, load_average, threads_line
from minillm.measure.metrics import timer

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


def time_fn(fn: Callable[[], Any], warmup: int = 1, repeat: int = 5) -> Timing:
    """Call `fn` warmup times untimed, then `repeat` times timed; synchronizes CUDA around each call."""
    if repeat < 1 or warmup < 0:
        raise ValueError(f"need repeat >= 1 and warmup >= 0, got repeat={repeat}, warmup={warmup}")
    for _ in range(warmup):
        fn()
    runs = []
    for _ in range(repeat):
        with timer() as t:
            fn()
        runs.append(t.seconds)
    return Timing(median=statistics.median(runs), min=min(runs), max=max(runs), runs=runs)


@dataclass
class PairedRatio:
    """Per-pair ratios t(fn) / t(reference) from interleaved runs: their median is the claim, their spread the
    noise."""

    median: float
    ratios: list[float]

    def __str__(self) -> str:
        return f"{self.median:.2f}x (pairs {min(self.ratios):.2f}-{max(self.ratios):.2f}, n={len(self.ratios)})"


def paired_ratio(fn: Callable[[], Any], reference: Callable[[], Any], pairs: int = 7, warmup: int = 1
                 ) -> PairedRatio:
    """How many times slower `fn` is than `reference`, robust to a shared, drifting machine: each pair times both
    back to back (the order alternates, so neither always runs on the warmer cache or the quieter moment) and the
    median of the per-pair ratios is kept. A machine that slows down mid-run slows both halves of a pair."""
    if pairs < 1 or warmup < 0:
        raise ValueError(f"need pairs >= 1 and warmup >= 0, got pairs={pairs}, warmup={warmup}")
    for _ in range(warmup):
        fn(), reference()
    ratios = []
    for i in range(pairs):
        seconds = {}
        for name, f in ((("fn", fn), ("ref", reference)) if i % 2 == 0 else (("ref", reference), ("fn", fn))):
            with timer() as t:
                f()
            seconds[name] = t.seconds
        ratios.append(seconds["fn"] / max(seconds["ref"], 1e-9))
    return PairedRatio(median=statistics.median(ratios), ratios=ratios)


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
    series: dict = field(default_factory=dict)  # curves for plots (e.g. a loss per step): saved, not printed
    hardware: dict | None = None  # filled from hardware_info(settings.get("device", "cpu")) when first needed
    quick: bool = False
    # ratio -> {"min", "median", "max", "runs": [...]} over whole repeated runs (run_entry(..., runs=N))
    spread: dict = field(default_factory=dict)

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
        """ratio name -> 'PASS' | 'MISS' | '-' (no target). A ratio measured over several runs is judged by its
        median (`spread`), not by the one run whose rows the result keeps."""
        def claim(k: str, v: float) -> float:
            return self.spread[k]["median"] if k in self.spread else v

        return {k: "-" if k not in self.targets else "PASS" if check_target(claim(k, v), self.targets[k]) else "MISS"
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
        print(f"   {threads_line()} at the end of the run (its own threads included)")
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
        for k, sp in self.spread.items():
            print(f"  {k} over {len(sp['runs'])} runs: min {_fmt(sp['min'])}, median {_fmt(sp['median'])}, "
                  f"max {_fmt(sp['max'])}")
        for note in self.notes:
            print(f"  note: {note}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["hardware"] = self._hardware()
        d["versions"] = _versions()
        d["timestamp"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        d["status"] = self.status()
        d["threads"], d["load_avg_end"] = torch.get_num_threads(), load_average()
        return d

    def save(self, dir: str | os.PathLike = "results") -> Path:
        """Write <dir>/<name>.json (rows, ratios, targets, status, settings, hardware, versions, timestamp, quick).

        A quick run goes to <dir>/quick/<name>.json: its tiny sizes must never replace a full run's numbers."""
        out = Path(dir) / "quick" if self.quick else Path(dir)
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
