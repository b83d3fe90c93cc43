"""Tiered hints for the exercises: `minillm hint NN [task] [--level 1|2|3]`, one level per call.

Three levels per task, written in tasks.toml: a nudge (what to think about), a detail of the contract and the trap
the grader checks, the recipe in words (for a real-model task: how to reproduce its check by hand). Showing one at a
time leaves the learner the work the next level would do. None of them is the code: tests/test_exercise_stubs.py
fails if a hint holds a line of the solution. The stub's docstring holds the contract; its NotImplementedError only
points here. Every lesson with an exercise (00-14).
"""

from __future__ import annotations

import textwrap

from minillm.course.grading import TASKS
from minillm.course.tasks import load_tasks

# task marker -> (level 1, level 2, level 3), written in tasks.toml
HINTS: dict[str, tuple[str, str, str]] = {task.marker: task.hints for task in load_tasks()}
LEVEL_NAMES = {1: "a nudge", 2: "the contract and its trap", 3: "the recipe"}


def hint(lesson: str, task: str | None = None, level: int = 1) -> str:
    """Level `level` of the hints of lesson's task (every task when None), alone: a learner climbs one rung per
    call, and the footer names the next one."""
    if lesson not in TASKS:
        raise ValueError(f"unknown lesson {lesson!r}; lessons with exercises: {', '.join(TASKS)}")
    if level not in LEVEL_NAMES:
        raise ValueError(f"hint levels are 1, 2 and 3, got {level}")
    markers = [m for m, _ in TASKS[lesson]]
    if task:
        wanted = task if task.startswith("task_") else f"task_{lesson}_{task.split('.')[-1]}"
        if wanted not in markers:
            raise ValueError(f"lesson {lesson} has tasks {', '.join(m.split('_', 2)[2] for m in markers)}")
        markers = [wanted]
    lines = []
    for m in markers:
        lines.append(f"{m}, hint {level} of 3 ({LEVEL_NAMES[level]}):")
        lines.append(textwrap.fill(HINTS[m][level - 1], width=116, initial_indent="  ",
                                   subsequent_indent="  ", break_on_hyphens=False))
    if level < 3:
        lines.append(f"(next: minillm hint {lesson}{' ' + task if task else ''} --level {level + 1})")
    return "\n".join(lines)
