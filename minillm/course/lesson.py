"""Small helpers shared by the lesson notebooks: quick mode, sizes, where results go.

A lesson run with MINILLM_QUICK=1 (CI does) uses small sizes so every notebook executes headless in seconds; the
numbers a learner reads come from full mode on their own hardware.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

QUICK = os.environ.get("MINILLM_QUICK", "") not in ("", "0")


def pick(full, quick):
    """`full` normally, `quick` under MINILLM_QUICK=1."""
    return quick if QUICK else full


def hardware_line() -> str:
    """One line naming the hardware a lesson's numbers come from; print it above every table."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}), torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU {cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}" + (" [QUICK mode]" if QUICK else "")
