"""Benchmarks: one entry per lesson, each measuring the previous technique against the next in one run.

    minillm bench --list
    minillm bench kv-cache --quick
    python -c "from minillm.bench import run_entry; run_entry('decode', quick=True)"

An entry is a function `run(quick: bool = False) -> BenchResult` registered below as "module:function"; the module is
imported only when its entry runs, so one broken or slow benchmark never affects the others.
"""

from __future__ import annotations

import importlib
import os

from minillm.measure.hardware import hardware_info
from minillm.measure.harness import BenchResult, Timing, time_fn

# name -> "module:function"; each lesson's helper adds one line
ENTRIES: dict[str, str] = {
    "decode": "minillm.bench.decode:run",
    "kv-cache": "minillm.bench.kv_cache:run",
    "gqa": "minillm.bench.gqa:run",
    "attention": "minillm.bench.attention:run",
    "paged": "minillm.bench.paged:run",
    "batching": "minillm.bench.batching:run",
    "fusion": "minillm.bench.fusion:run",
    "quant": "minillm.bench.quant:run",
    "lowbit": "minillm.bench.lowbit:run",
    "sparsity": "minillm.bench.sparsity:run",
    "distill": "minillm.bench.distill:run",
    "speculative": "minillm.bench.speculative:run",
    "parallel": "minillm.bench.parallel:run",
    "serve": "minillm.bench.serve:run",
    "prefix-cache": "minillm.bench.prefix_cache:run",
    "chunked-prefill": "minillm.bench.chunked_prefill:run",
    "disagg": "minillm.bench.disagg:run",
    "ladder": "minillm.bench.ladder:run",
    "edge": "minillm.bench.edge:run",
    "breakdown": "minillm.bench.breakdown:run",
}

__all__ = ["ENTRIES", "BenchResult", "Timing", "hardware_info", "load_entry", "run_entry", "time_fn"]


def load_entry(name: str):
    """The `run` function registered under `name`."""
    if name not in ENTRIES:
        raise ValueError(f"unknown benchmark {name!r}; available: {', '.join(ENTRIES)}")
    module, fn = ENTRIES[name].split(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            raise ValueError(f"benchmark {name!r} is registered as {ENTRIES[name]} but {module} "
                             f"does not exist yet") from e
        raise
    return getattr(mod, fn)


def run_entry(name: str, quick: bool = False, save: bool = True, out: str | os.PathLike = "results",
              **options) -> BenchResult:
    """Run benchmark `name`, print its table, and (with save) write <out>/<name>.json. Returns the result.
    `options` go to the entry's run() as they are (e.g. bench serve's url and rate)."""
    result = load_entry(name)(quick=quick, **options)
    if not isinstance(result, BenchResult):
        raise TypeError(f"benchmark {name!r} returned {type(result).__name__}, expected BenchResult")
    result.quick = quick
    result.print_table()
    if save:
        path = result.save(out)
        print(f"saved {path}")
    return result
