"""One source of truth: each solution is minillm's own function, and each stub has its solution's signature."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULES = sorted(p.stem for p in (ROOT / "solutions").glob("ex*.py"))


def test_every_exercise_has_solution_and_grader():
    exercises = sorted(p.stem for p in (ROOT / "exercises").glob("ex*.py"))
    assert exercises == MODULES
    for m in MODULES:
        assert (ROOT / "tests" / "graders" / f"test_{m}.py").exists(), f"no grader for {m}"


@pytest.mark.parametrize("module", MODULES)
def test_solution_is_verbatim_engine_code(module):
    sol = importlib.import_module(f"solutions.{module}")
    same_as = getattr(sol, "SAME_AS", None)
    assert same_as, f"solutions/{module}.py must declare SAME_AS = {{function: 'minillm.module'}}"
    for name, engine_module in same_as.items():
        ours = getattr(sol, name)
        engine = getattr(importlib.import_module(engine_module), name)
        assert inspect.getsource(ours) == inspect.getsource(engine), (
            f"solutions/{module}.py:{name} has drifted from {engine_module}.{name}; copy the engine's version")


@pytest.mark.parametrize("module", MODULES)
def test_stub_matches_solution_signatures(module):
    sol = importlib.import_module(f"solutions.{module}")
    ex = importlib.import_module(f"exercises.{module}")
    for name in sol.SAME_AS:
        stub = getattr(ex, name, None)
        assert stub is not None, f"exercises/{module}.py lacks {name}"
        assert inspect.signature(stub) == inspect.signature(getattr(sol, name)), f"{module}.{name} signature drifted"
        assert "NotImplementedError" in inspect.getsource(stub), f"exercises/{module}.py:{name} is not a stub"
