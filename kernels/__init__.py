"""minillm_kernels: the ground floor, importing nothing of minillm. Triton kernels for a GPU (flash_attn, paged_decode,
quant_matmul: lessons 03, 04, 07) and C++ SIMD kernels for a CPU (cpu_lowbit: lesson 07).

Importing the package stays cheap and imports no triton: triton fixes its mode (driver or interpreter) when first
imported, which _triton_env.py must decide. `triton_available()` is the one way minillm asks whether it is there.
"""

from __future__ import annotations

import importlib.util


def triton_available() -> bool:
    """Is triton installed? Asked of the import system, not by importing it (that would fix its mode too early)."""
    return importlib.util.find_spec("triton") is not None
