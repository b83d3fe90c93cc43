"""Grader plumbing: pick solutions/ or the learner's exercises/, and catch answers that call the library op."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import textwrap
from pathlib import Path

import pytest

from minillm.course.grading import all_markers

ROOT = Path(__file__).resolve().parent.parent.parent
TARGET = os.environ.get("MINILLM_GRADE", "solutions")
if TARGET not in ("solutions", "exercises"):
    raise ValueError(f"MINILLM_GRADE must be 'solutions' or 'exercises', got {TARGET!r}")


def pytest_configure(config):
    for marker, what in all_markers():
        config.addinivalue_line("markers", f"{marker}: {what}")


def load_impl(module: str):
    """`exNN_topic` from solutions/ (default) or exercises/ (MINILLM_GRADE=exercises)."""
    return importlib.import_module(f"{TARGET}.{module}")


def forbid_calls(fn, names: list[str]) -> None:
    """Fail if `fn`'s source calls or imports any of `names` (e.g. 'scaled_dot_product_attention', 'minillm')."""
    src = textwrap.dedent(inspect.getsource(fn))
    tree = ast.parse(src)
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            used.update(a.name.split(".")[0] for a in node.names)
            if isinstance(node, ast.ImportFrom) and node.module:
                used.add(node.module.split(".")[0])
    bad = sorted(used & set(names))
    if bad:
        pytest.fail(f"{fn.__name__} uses {bad}: implement it yourself instead of calling the library")
    forbid_reference_imports(fn)


def given_names(module: str) -> set[str]:
    """Names the course hands the learner: what exercises/<module>.py and solutions/<module>.py import from minillm
    at module level (input checks, error types, the engine's data classes)."""
    names: set[str] = set()
    for folder in ("exercises", "solutions"):
        path = ROOT / folder / f"{module}.py"
        if not path.exists():
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("minillm", "minillm_kernels"):
                names.update(a.asname or a.name for a in node.names)
    return names


def _is_reference(obj) -> bool:
    name = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", None) or ""
    return name.split(".")[0] in ("minillm", "minillm_kernels", "solutions")


def forbid_reference_imports(fn) -> None:
    """Fail if `fn` is the reference itself (imported from minillm or solutions/), or if it, or a helper of the same
    module that it calls, reaches a minillm function, class or module through a module-level import or alias
    (`from minillm.model import rms_norm as _a`). The given names (given_names) are allowed."""
    target = getattr(fn, "__wrapped__", fn)
    exercise_module = f"{TARGET}."
    home = getattr(target, "__module__", "") or ""
    if not home.startswith(exercise_module):
        pytest.fail(f"{getattr(fn, '__name__', fn)} comes from {home}, not from your {TARGET}/ file: write it "
                    f"there instead of importing the reference")
    given = given_names(home.split(".", 1)[1])
    seen: set[int] = set()

    def code_names(code) -> set[str]:
        out = set(code.co_names)
        for const in code.co_consts:
            if inspect.iscode(const):
                out |= code_names(const)
        return out

    def visit(obj) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if inspect.isclass(obj):
            members = [v for v in vars(obj).values() if inspect.isfunction(v)]
        elif inspect.isfunction(obj):
            members = [obj]
        else:
            return
        for f in members:
            for name in code_names(f.__code__):
                value = f.__globals__.get(name)
                if value is None or name in given:
                    continue
                if (inspect.isfunction(value) or inspect.isclass(value)) and \
                        (getattr(value, "__module__", "") or "") == home:
                    visit(value)  # a helper of the learner's own module: follow it
                elif (inspect.ismodule(value) or callable(value)) and _is_reference(value):
                    pytest.fail(f"{getattr(fn, '__name__', fn)} reaches {name} = "
                                f"{getattr(value, '__module__', None) or value.__name__}."
                                f"{getattr(value, '__qualname__', '')} through a module-level import: implement "
                                f"it yourself instead of importing the reference")

    visit(target)
