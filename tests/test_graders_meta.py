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
