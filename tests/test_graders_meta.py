"""Graders must be able to fail: every task fails on the stubs in exercises/ and passes on solutions/."""

from __future__ import annotations

import pytest

from minillm.grading import ROOT, TASKS, run_graders

LESSONS = [lesson for lesson in TASKS if list((ROOT / "tests" / "graders").glob(f"test_ex{lesson}_*.py"))]


@pytest.mark.parametrize("lesson", LESSONS)
def test_solutions_pass_and_stubs_fail(lesson):
    solved = run_graders(lesson, "solutions")
    stubs = run_graders(lesson, "exercises")
    for task, outcome in solved.items():
        assert outcome in ("pass", "skip"), f"{task} does not pass on solutions/ ({outcome})"
        if outcome == "pass":
            assert stubs[task] == "fail", f"{task} passes on the stub: its grader cannot fail"


# ------------------------------------------------------------------------------------------- the mutant list

from tests.graders.mutants import MUTANTS  # noqa: E402

MUTANT_LESSONS = sorted({m.lesson for m in MUTANTS})


def test_every_task_has_a_mutant():
    covered = {m.task for m in MUTANTS}
    required = {task for lesson in MUTANT_LESSONS for task, what in TASKS[lesson] if not what.startswith("optional")}
    assert required <= covered, f"tasks without a mutant in tests/graders/mutants.py: {sorted(required - covered)}"


@pytest.mark.parametrize("lesson", MUTANT_LESSONS)
def test_every_mutant_fails_its_task(lesson):
    """Each committed mutant (a solution with one known bug edited in) makes its task's graders fail."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "tests.graders.mutants", lesson], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env={**__import__("os").environ, "MINILLM_GRADE": "solutions"})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("MUTANTS ")), None)
    assert line is not None, f"the mutant runner failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = json.loads(line[len("MUTANTS "):])
    assert set(results) == {m.name for m in MUTANTS if m.lesson == lesson}
    survivors = [name for name, outcome in results.items() if outcome != "killed"]
    assert not survivors, f"mutants that pass their task's graders (strengthen the grader): {survivors}"
