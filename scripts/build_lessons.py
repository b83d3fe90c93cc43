"""Execute lessons/NN_name.py as a notebook (full mode unless MINILLM_QUICK=1) and save lessons/NN_name.ipynb with
its outputs, so a code host shows tables and plots without running anything.

    python scripts/build_lessons.py                 # every lesson
    python scripts/build_lessons.py lessons/01_kv_cache.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jupytext
import nbclient

ROOT = Path(__file__).resolve().parent.parent


def build(src: Path) -> Path:
    nb = jupytext.read(src)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata.setdefault("jupytext", {})["formats"] = "ipynb,py:percent"
    t0 = time.time()
    nbclient.NotebookClient(nb, timeout=3600, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "lessons")}}).execute()
    out = src.with_suffix(".ipynb")
    jupytext.write(nb, out)
    print(f"{out.relative_to(ROOT)}: executed in {time.time() - t0:.0f} s")
    return out


if __name__ == "__main__":
    paths = [Path(p).resolve() for p in sys.argv[1:]] or sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))
    for p in paths:
        build(p)
