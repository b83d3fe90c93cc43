"""Importing the peers minillm is measured against (transformers), safely from anywhere, this repository included.

transformers >= 5.25 imports `kernels` (Hugging Face's hub-kernels distribution) whenever it is installed. Run from
this repository's root (python -m, pytest, a notebook in the checkout), the top-level kernels/ folder, which is
installed as minillm_kernels, is found under that name first, and transformers' import fails with ImportError.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]  # the checkout's root: minillm/measure/peers.py -> ..


def _import_hub_kernels() -> None:
    """Import the `kernels` distribution from where pip put it, before anything can find this repo's kernels/."""
    if "kernels" in sys.modules:
        return
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return  # not installed: transformers does not import it
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _REPO]
    try:
        importlib.import_module("kernels")
    except ImportError:
        pass  # a broken install: transformers then reports it in its own words
    finally:
        sys.path[:] = saved


def import_transformers():
    """`import transformers` (ImportError where it is not installed, as a plain import would)."""
    _import_hub_kernels()
    return importlib.import_module("transformers")
