"""Grader plumbing: pick solutions/ or the learner's exercises/, and catch answers that call the library op."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import textwrap

import pytest

from minillm.grading import all_markers

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
