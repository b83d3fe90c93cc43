"""Every lesson executes headless as a notebook (quick mode), and its committed .ipynb matches its .py source."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))

jupytext = pytest.importorskip("jupytext")


def _code_cells(nb) -> list[str]:
    return [c.source.strip() for c in nb.cells if c.cell_type in ("code", "markdown")]


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_committed_notebook_matches_source(lesson):
    ipynb = lesson.with_suffix(".ipynb")
    assert ipynb.exists(), f"{ipynb.name} is missing: run python scripts/build_lessons.py {lesson.relative_to(ROOT)}"
    assert _code_cells(jupytext.read(lesson)) == _code_cells(jupytext.read(ipynb)), (
        f"{ipynb.name} is stale: run python scripts/build_lessons.py {lesson.relative_to(ROOT)}")
    executed = jupytext.read(ipynb)
    assert any(c.get("outputs") for c in executed.cells if c.cell_type == "code"), f"{ipynb.name} has no outputs"


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_executes_headless(lesson, tmp_path):
    nbclient = pytest.importorskip("nbclient")
    nb = jupytext.read(lesson)
    env = {"MINILLM_QUICK": "1", "MPLBACKEND": "Agg"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
