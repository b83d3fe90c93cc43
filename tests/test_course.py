"""Course conventions that a test can hold (lessons/README.md lists them all).

- No lesson shows an exercise's answer: no cell prints the source of a function that solutions/ copies from the
  engine (SAME_AS), and no committed notebook output contains its definition.
"""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))


def solution_names() -> set[str]:
    """Every function/class an exercise asks for (SAME_AS keys of every solutions/exNN module), plus the Triton
    inner step of exercise 03, which is copied from kernels/ rather than from minillm/."""
    names = {"attend_key_block"}
    for path in sorted((ROOT / "solutions").glob("ex*.py")):
        names.update(getattr(importlib.import_module(f"solutions.{path.stem}"), "SAME_AS", {}))
    return names


def _dotted_names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_no_lesson_prints_solution_source(lesson):
    answers = solution_names()
    tree = ast.parse(lesson.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and "getsource" in _dotted_names(node.func):
            shown = set().union(*(_dotted_names(a) for a in node.args)) & answers
            assert not shown, (f"{lesson.name}:{node.lineno} prints the source of {sorted(shown)}, an exercise's "
                               f"answer: show the math, pseudocode or the engine's use of it instead")


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_no_notebook_output_contains_a_solution(lesson):
    ipynb = lesson.with_suffix(".ipynb")
    if not ipynb.exists():
        pytest.skip("no executed notebook")
    outputs = []
    for cell in json.loads(ipynb.read_text())["cells"]:
        for out in cell.get("outputs", []):
            text = out.get("text") or out.get("data", {}).get("text/plain") or ""
            outputs.append("".join(text) if isinstance(text, list) else text)
    blob = "\n".join(outputs)
    leaked = sorted(n for n in solution_names() if f"def {n}(" in blob or f"class {n}" in blob)
    assert not leaked, f"{ipynb.name} shows the definition of {leaked} in a cell output (an exercise's answer)"


# ------------------------------------------------------------------------------------------------ tiered hints

@pytest.mark.parametrize("lesson", ["00", "01", "02", "03", "04", "05"])
def test_every_task_has_three_hint_levels(lesson):
    from minillm.grading import TASKS
    from minillm.hints import HINTS, _recipes, hint

    recipes = _recipes(lesson)
    for marker, _ in TASKS[lesson]:
        assert marker in HINTS and all(HINTS[marker]), f"{marker} has no level 1/2 hint in minillm/hints.py"
        assert marker in recipes, f"{marker}: no 'task NN.name: ...' recipe in its stub"
        task = marker.split("_", 2)[2]
        one, three = hint(lesson, task, 1), hint(lesson, task, 3)
        assert HINTS[marker][0] in one and HINTS[marker][1] not in one  # level 1 is only the nudge
        assert HINTS[marker][1] in three and recipes[marker].splitlines()[0] in three


def test_cli_hint_and_generate_compile_flag(capsys):
    from minillm.cli import build_parser, main

    assert build_parser().parse_args(["generate", "hi", "--compile"]).compile is True
    assert build_parser().parse_args(["generate", "hi"]).compile is False
    assert main(["hint", "00", "rope", "--level", "2"]) == 0
    assert "rotate" in capsys.readouterr().out.lower()
