"""Small helpers shared by the lesson notebooks (every lesson): quick mode, sizes, the hardware line.

Under MINILLM_QUICK=1 (CI sets it) `QUICK` is true and `pick(full, quick)` gives the small sizes, so every
notebook executes headless in seconds; the numbers a learner reads come from full mode on their own hardware.
`hardware_line` names the machine above every table; `recorded` reads a benchmark's full run from results/.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from minillm.measure.hardware import machine_line

RESULTS = Path(__file__).resolve().parents[2] / "results"

QUICK = os.environ.get("MINILLM_QUICK", "") not in ("", "0")


def pick(full, quick):
    """`full` normally, `quick` under MINILLM_QUICK=1."""
    return quick if QUICK else full


def hardware_line() -> str:
    """One line naming the hardware a lesson's numbers come from (minillm.measure.hardware names it), and quick
    mode when on; print it above every table."""
    return machine_line() + (" [QUICK mode]" if QUICK else "")


def spread_line(result: dict, key: str) -> str:
    """A recorded ratio with its spread over whole runs (`minillm bench NAME --runs 3` records it), or a plain
    statement that the file holds one run."""
    value, spread = result["ratios"][key], result.get("spread", {}).get(key)
    if not spread:
        return (f"{key} = {value:.3f} (one run, no spread: `minillm bench {result['name']} --runs 3` "
                f"records one)")
    return (f"{key} = {value:.3f}: min {spread['min']:.3f}, median {spread['median']:.3f}, max {spread['max']:.3f} "
            f"over {len(spread['runs'])} runs")


def recorded(name: str, quick_run: bool = True, rerun: str | None = None) -> dict:
    """The full run of `minillm bench NAME` recorded in results/NAME.json (a benchmark of many minutes is read, not
    re-run, by a lesson in full mode); quick mode, or no such file, runs the quick benchmark now, unless quick_run is
    False (a bench whose quick run alone takes minutes: quick mode reads the recorded file too)."""
    path = RESULTS / f"{name}.json"
    if (QUICK and quick_run) or not path.exists():
        from minillm.bench import run_entry

        return run_entry(name, quick=True, save=False).to_dict()
    result = json.loads(path.read_text())
    print(f"the run recorded in results/{name}.json ({result['timestamp']}), on: {result['hardware'].get('cpu', '')}, "
          f"{result['settings'].get('threads', '?')} thread(s), load average {result.get('load_avg_end', 0):.1f} at "
          f"its end; rerun: {rerun or 'minillm bench ' + name}")
    return result
