"""Import triton the way every kernel in minillm_kernels needs it: `from ._triton_env import triton, tl, INTERPRET`.

Triton decides at the moment a `@triton.jit` function is *defined* whether it will run on a GPU driver or in the
interpreter (TRITON_INTERPRET=1: every program of the grid runs on the CPU through numpy; slow but exact enough to
check a kernel), and triton's own library functions (tl.zeros, tl.max, ...) are defined when triton is first
imported. So TRITON_INTERPRET has to be set before triton is imported at all -- and torch imports it lazily (dynamo,
torch.utils.flop_counter). On a machine without CUDA we therefore set TRITON_INTERPRET=1 here *and* in
minillm/__init__.py (setdefault: an explicit TRITON_INTERPRET=0/1 from the user wins). It changes the variable for
the whole process, which is what a CPU-only machine wants anyway. If triton was already imported for a driver, the
kernels could not run; importing this module then raises a RuntimeError that says so, instead of failing later.

Interpreter traps this package's kernels respect (FACTS.md): bf16 arithmetic is wrong there, so kernels load and
then `.to(tl.float32)`; tl.arange needs powers of 2; tiles stay >= 16; an unmasked out-of-bounds load segfaults
instead of raising, so every load that can run past the end is masked; autotune needs a driver.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl
except ImportError as err:  # the kernels are an optional extra
    raise ImportError(
        'minillm_kernels needs triton, which is not installed: pip install -e ".[kernels]" (Linux only)'
    ) from err

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

if INTERPRET:
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.zeros, InterpretedFunction):  # triton's own library was built for a driver
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set (torch.utils.flop_counter and torch.compile "
            "import it), so its kernels cannot run in the interpreter. Set TRITON_INTERPRET=1 in the environment, "
            "or import minillm_kernels before those modules.")

__all__ = ["INTERPRET", "tl", "triton"]
