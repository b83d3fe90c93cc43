"""Import triton the way every kernel in minillm_kernels needs it: `from ._triton_env import triton, tl, INTERPRET`.

Triton fixes when first imported (and at each `@triton.jit` definition) whether kernels run on a GPU driver or in the
interpreter (TRITON_INTERPRET=1: the grid runs on the CPU through numpy, slow but exact enough to check a kernel), and
torch imports it lazily (dynamo, flop_counter). So without CUDA this module and minillm/__init__.py setdefault
TRITON_INTERPRET=1 first (an explicit 0/1 wins); if triton already came in for a driver, importing this raises.
Interpreter traps the kernels respect (FACTS.md): bf16 arithmetic is wrong (load, then .to(tl.float32)); tl.arange
wants powers of 2; tiles stay >= 16; a load that can run past the end is masked (else a segfault); no autotune.
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
