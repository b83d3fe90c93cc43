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
import statistics

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
    "codebook": "minillm.bench.codebook:run",
    "sparsity": "minillm.bench.sparsity:run",
    "pruning": "minillm.bench.pruning:run",
    "distill": "minillm.bench.distill:run",
    "speculative": "minillm.bench.speculative:run",
    "drafter-domains": "minillm.bench.drafter_domains:run",
    "parallel": "minillm.bench.parallel:run",
    "serve": "minillm.bench.serve:run",
    "prefix-cache": "minillm.bench.prefix_cache:run",
    "chunked-prefill": "minillm.bench.chunked_prefill:run",
    "disagg": "minillm.bench.disagg:run",
    "cascade": "minillm.bench.specialist_cascade:run",
    "http-router": "minillm.bench.http_router:run",
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
              runs: int = 1, **options) -> BenchResult:
    """Run benchmark `name`, print its table, and (with save) write <out>/<name>.json. Returns the result.
    `options` go to the entry's run() as they are (e.g. bench serve's url and rate). `runs` > 1 repeats the whole
    benchmark: the result keeps the rows of the run whose headline (the first targeted ratio, else the first ratio)
    is the median, and `spread` holds every ratio's min/median/max over the runs."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    results = []
    for i in range(runs):
        result = load_entry(name)(quick=quick, **options)
        if not isinstance(result, BenchResult):
            raise TypeError(f"benchmark {name!r} returned {type(result).__name__}, expected BenchResult")
        if runs > 1:
            print(f"[run {i + 1} of {runs}] " + ", ".join(f"{k} = {v:.3f}" for k, v in result.ratios.items()))
        results.append(result)
    if runs > 1:
        result = median_run(results)
        result.notes.append(f"{runs} whole runs of this benchmark one after another; the rows are those of the run "
                            f"with the median {median_key(results)}")
    result.quick = quick
    result.print_table()
    if save:
        path = result.save(out)
        print(f"saved {path}")
    return result


def headline(result: BenchResult) -> str | None:
    """The ratio a benchmark leads with: its first targeted ratio, else its first ratio (None: it has none)."""
    return next(iter(result.targets), next(iter(result.ratios), None))


def median_key(results: list[BenchResult]) -> str | None:
    """The ratio whose median picks the run: the headline, unless every run has the same value of it (a check all
    pass alike, such as greedy_identical = 1, picks no median), then the first targeted ratio that varies."""
    key = headline(results[0])
    if key is not None and len({r.ratios.get(key) for r in results}) == 1:
        key = next((k for k in results[0].targets if len({r.ratios.get(k) for r in results}) > 1), key)
    return key


def median_run(results: list[BenchResult]) -> BenchResult:
    """The run whose headline ratio is the median of `results`, with `spread` filled from all of them."""
    key = median_key(results)
    ordered = sorted(results, key=lambda r: r.ratios.get(key, float("nan"))) if key else results
    chosen = ordered[(len(ordered) - 1) // 2]
    for k in chosen.ratios:
        vals = [float(r.ratios[k]) for r in results if k in r.ratios]
        finite = sorted(v for v in vals if v == v and abs(v) != float("inf"))
        if finite:
            chosen.spread[k] = {"min": finite[0], "median": statistics.median(finite), "max": finite[-1],
                                "runs": vals}
    return chosen
