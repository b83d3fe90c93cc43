"""Benchmark "disagg" (lesson 13): three ways to spend a fixed set of cores on many requests, in one run.

  pd        prefill and decode workers vs one colocated engine, chunked prefill or not (disagg_pd.py);
  routing   two engine replicas behind round-robin, least-tokens or prefix-affinity routing (routing.py);
  cascade   the distilled student answers first, SmolLM2 when it is unsure (cascade.py).
Each part is measured side by side within itself; the parts share only the machine. `parts` picks a subset
(`minillm bench disagg --part routing`); every worker and replica runs `threads` torch threads (default 1).
"""

from __future__ import annotations

import importlib

import torch

from minillm.measure.harness import BenchResult
from minillm.measure.metrics import timer

PARTS = {"pd": "minillm.bench.disagg_pd", "routing": "minillm.bench.routing", "cascade": "minillm.bench.cascade"}


def run(quick: bool = False, threads: int = 1, parts: tuple[str, ...] | list[str] | str = tuple(PARTS)) -> BenchResult:
    parts = (parts,) if isinstance(parts, str) else tuple(parts)
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise ValueError(f"unknown part(s) {unknown or parts}: choose from {list(PARTS)}")
    torch.set_num_threads(threads)
    rows, ratios, targets, notes, series, settings = [], {}, {}, [], {}, {"quick": quick, "threads": threads,
                                                                         "device": "cpu", "parts": list(parts)}
    for part in parts:
        with timer() as t:
            out = importlib.import_module(PARTS[part]).measure(quick=quick, threads=threads)
        rows += [{"part": part, **r} for r in out.get("rows", [])]
        for name, value in out.get("ratios", {}).items():
            key = name if name not in ratios else f"{part}_{name}"
            ratios[key] = value
            if name in out.get("targets", {}):
                targets[key] = tuple(out["targets"][name])
        notes += [f"[{part}] {n}" for n in out.get("notes", [])]
        series[part] = out.get("series", {})
        settings[part] = {**out.get("settings", {}), "seconds": round(t.seconds, 1)}
    return BenchResult(name="disagg", rows=rows, ratios=ratios, targets=targets, settings=settings, notes=notes,
                       series=series, quick=quick)
