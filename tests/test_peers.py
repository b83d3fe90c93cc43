"""The peer import (minillm/measure/peers.py): transformers imports from the repository's root, where its top-level
kernels/ folder would shadow Hugging Face's `kernels` distribution that transformers >= 5.25 imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_transformers_imports_from_the_repository_root():
    pytest.importorskip("transformers")
    # hub_kernels is what imports `kernels` (lazily: from_pretrained reaches it); without the fix it raised
    # "cannot import name 'CUDAProperties' from 'kernels' (<repo>/kernels/__init__.py)" with transformers 5.25
    code = ("import sys; sys.path.insert(0, ''); from minillm.measure.peers import import_transformers; "
            "t = import_transformers(); import transformers.integrations.hub_kernels; k = sys.modules.get('kernels'); "
            "print(t.__name__, getattr(k, '__file__', None) or '-')")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    name, kernels_file = run.stdout.split()
    assert name == "transformers"
    assert kernels_file == "-" or not Path(kernels_file).resolve().is_relative_to(ROOT), (
        f"transformers got this repository's kernels/ folder as Hugging Face's `kernels`: {kernels_file}")
