"""Small helpers shared by the lesson notebooks (every lesson): quick mode, sizes, the hardware line.

Under MINILLM_QUICK=1 (CI sets it) `QUICK` is true and `pick(full, quick)` gives the small sizes, so every
notebook executes headless in seconds; the numbers a learner reads come from full mode on their own hardware.
`hardware_line` names the machine above every table.
"""

from __future__ import annotations

import os

from minillm.measure.hardware import machine_line

QUICK = os.environ.get("MINILLM_QUICK", "") not in ("", "0")


def pick(full, quick):
    """`full` normally, `quick` under MINILLM_QUICK=1."""
    return quick if QUICK else full


def hardware_line() -> str:
    """One line naming the hardware a lesson's numbers come from (minillm.measure.hardware names it), and quick
    mode when on; print it above every table."""
    return machine_line() + (" [QUICK mode]" if QUICK else "")
