"""Course conventions that a test can hold (lessons/README.md lists them all).

- No lesson shows an exercise's answer: no cell prints the source of a function that solutions/ copies from the
  engine (SAME_AS), and no committed notebook output contains its definition.
- Prose never outruns the numbers: no markdown cell states a measured speed comparison ("3.1x faster", "**slower**",
  "faster than X by 20 ms"); such a sentence is printed by the cell that measured it. A few regexes, so a rephrased
  claim can slip through: they catch the forms these lessons used.
- Every lesson points to its exercise at the end (`minillm grade NN`) and asks for one prediction that the next cell
  measures.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
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


# ------------------------------------------------------------------------------------------- hints and grading
# (the three hint levels and stubs without solution code: tests/test_exercise_stubs.py)

def test_cli_hint_and_generate_compile_flag(capsys):
    from minillm.cli import build_parser, main

    assert build_parser().parse_args(["generate", "hi", "--compile"]).compile is True
    assert build_parser().parse_args(["generate", "hi"]).compile is False
    assert main(["hint", "00", "rope", "--level", "2"]) == 0
    out = capsys.readouterr().out
    assert "rotate" in out.lower() and "hint 2 of 3" in out and "--level 3" in out
    assert main(["hint", "00", "rope"]) == 0  # level 1 alone: the contract is one more call away
    out = capsys.readouterr().out
    assert "hint 1 of 3" in out and "Rotate-half pairing" not in out


LONG = ("test_x: n_heads=9, n_kv_heads=3, head_dim=64, shape (2, 5, 48): the fused rows must be q's, then k's, then "
        "v's; got k's first. expected tensor([1., 2., 3.]) got tensor([3., 2., 1.])")


def test_grade_report_keeps_the_whole_message_and_drops_pytest_advice():
    from minillm.course.grading import failure_summary

    assert len(LONG) > 160
    summary = failure_summary(f"AssertionError: {LONG}\nassert False", test="test_qkv")
    assert LONG in summary and summary.startswith("test_qkv:")
    listed = failure_summary("assert [1, 2, 3] == [1, 2, 4]\n  \n  At index 2 diff: 3 != 4\n  Use -v to get more diff")
    assert "At index 2 diff: 3 != 4" in listed and "-v" not in listed


def test_grade_report_names_the_call_that_raised(tmp_path):
    """Graded end to end through pytest: a learner's function that raises is named with its file and line, with the
    grader's call that reached it; a long assertion message comes back whole; pytest's -v advice never does."""
    from minillm.course.grading import LAST_FAILURES, _grade_files

    (tmp_path / "exercises").mkdir()
    (tmp_path / "exercises" / "exfake.py").write_text(
        "def pick(ids, k):\n    if k > len(ids):\n        raise ValueError(f'k={k} is more than {len(ids)} ids')\n"
        "    return ids[:k]\n\n\ndef stub(x):\n"
        "    raise NotImplementedError('task 00.rope: see the docstring; `minillm hint 00 rope` for hints')\n")
    grader = tmp_path / "test_exfake.py"
    grader.write_text(
        "import sys\nimport pytest\nsys.path.insert(0, {!r})\nfrom exfake import pick, stub\n\n"
        "@pytest.mark.task_00_rmsnorm\ndef test_pick():\n    assert pick([1, 2], 3) == [1, 2]\n\n"
        "@pytest.mark.task_00_attention\ndef test_long():\n    assert pick([1, 2, 3], 2) == [1, 2, 4], {!r}\n\n"
        "@pytest.mark.task_00_sampler\ndef test_list():\n    assert pick([1, 2, 3], 3) == [1, 2, 4]\n\n"
        "@pytest.mark.task_00_rope\ndef test_stub():\n    stub(1)\n".format(str(tmp_path / "exercises"), LONG))
    outcomes = _grade_files([grader], dict(os.environ), tmp_path)
    assert set(outcomes.values()) == {"fail"}
    raised = LAST_FAILURES["task_00_rmsnorm"]
    assert "your pick raised ValueError: k=3 is more than 2 ids" in raised
    assert "exercises/exfake.py:3" in raised and "pick([1, 2], 3)" in raised
    assert LONG in LAST_FAILURES["task_00_attention"]
    assert "At index 2 diff" in LAST_FAILURES["task_00_sampler"]
    assert all("-v" not in text for text in LAST_FAILURES.values())
    assert "your stub is not written yet: task 00.rope: see the docstring" in LAST_FAILURES["task_00_rope"]


# ------------------------------------------------------------------------------------ prose vs measured numbers

# a typed speed verdict: "3.1x faster", "faster than naive by 2 ms", "12 ms ... slower", a bold **faster**/**slower**
MEASURED_CLAIMS = [
    r"\d[\d.]*\s*(?:x|×)\s+(?:faster|slower)\b",
    r"\b(?:faster|slower)\s+(?:by|than)\b[^.\n]{0,30}\d",
    r"\d[\d.]*\s*(?:ms|µs|us|tok/s|GB/s)\b[^.\n]{0,40}\b(?:faster|slower)\b",
    r"\*\*(?:faster|slower)\*\*",
]


def markdown_claims(source: str) -> list[str]:
    import re

    return [source[max(0, m.start() - 40):m.end() + 20].replace("\n", " ")
            for pat in MEASURED_CLAIMS for m in re.finditer(pat, source, re.IGNORECASE)]


def test_claim_patterns_catch_typed_verdicts():
    assert markdown_claims("On a CPU the torch flash loop is **slower** than naive attention")  # lesson 03, before
    assert markdown_claims("MQA decodes 1.4x faster than GQA at 4k tokens")
    assert not markdown_claims("Llama-2-70B has 2.5x more layers")  # a config fact, not a measurement
    assert not markdown_claims("read the flash/naive column: below 1, the loop was faster")


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_no_markdown_states_a_measured_comparison(lesson):
    jupytext = pytest.importorskip("jupytext")
    claims = [c for cell in jupytext.read(lesson).cells if cell.cell_type == "markdown"
              for c in markdown_claims(cell.source)]
    assert not claims, (f"{lesson.name}: markdown states a measured comparison, which a rerun can contradict; print it "
                        f"from the numbers in the cell that measures them: {claims}")


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_every_lesson_ends_with_its_exercise(lesson):
    jupytext = pytest.importorskip("jupytext")
    n = lesson.name[:2]
    tail = [c.source for c in jupytext.read(lesson).cells if c.cell_type == "markdown"][-2:]
    assert any(f"minillm grade {n}" in t for t in tail), (
        f"{lesson.name}: the last markdown cells should point to exercise {n} "
        f"(`minillm grade {n}`, `minillm hint {n}`)")


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_every_lesson_asks_for_a_prediction_the_next_cell_measures(lesson):
    """Predict, then measure: a markdown cell asks the learner to write a number down, and the cell right after it is
    the code that measures it."""
    jupytext = pytest.importorskip("jupytext")
    cells = jupytext.read(lesson).cells
    asks = [i for i, c in enumerate(cells)
            if c.cell_type == "markdown" and "Predict before you run the next cell" in c.source]
    assert asks, f"{lesson.name}: no 'Predict before you run the next cell:' question (lessons/README.md conventions)"
    for i in asks:
        assert i + 1 < len(cells) and cells[i + 1].cell_type == "code", (
            f"{lesson.name}: the prediction question in cell {i} must be followed by the code cell that measures it")


def _output_text(cell: dict) -> str:
    text = []
    for out in cell.get("outputs", []):
        t = out.get("text") or out.get("data", {}).get("text/plain") or ""
        text.append("".join(t) if isinstance(t, list) else t)
    return "\n".join(text)


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_every_prediction_closes_with_a_measured_line(lesson):
    """Each predict cell is answered by the run: a code cell after it (before the next section or question) printed a
    line with both 'predicted' and 'measured', from the executed notebook's own outputs."""
    ipynb = lesson.with_suffix(".ipynb")
    if not ipynb.exists():
        pytest.skip("no executed notebook")
    cells = json.loads(ipynb.read_text())["cells"]
    src = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in cells]
    asks = [i for i, c in enumerate(cells)
            if c["cell_type"] == "markdown" and "Predict before you run the next cell" in src[i]]
    for i in asks:
        answered = False
        for j in range(i + 1, len(cells)):
            if cells[j]["cell_type"] == "markdown" and (
                    src[j].lstrip().startswith("## ") or "Predict before you run the next cell" in src[j]):
                break
            if cells[j]["cell_type"] == "code" and any(
                    "predicted" in line.lower() and "measured" in line.lower()
                    for line in _output_text(cells[j]).splitlines()):
                answered = True
                break
        assert answered, (f"{ipynb.name}: the prediction asked in cell {i} is never closed: print 'predicted X, "
                          f"measured Y, because <the computed term>' before the next section")
