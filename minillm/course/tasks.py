"""The course's graded tasks, read from one table (tasks.toml): lesson, marker, description and three hints each.

The prose lives in a data file, once per task, instead of Python dicts keyed by the same markers twice (grading's task
list and the hints); grading.py and hints.py both read it here. Every lesson with an exercise (00-14).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, fields
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser before it joined the standard library (pyproject's dependencies install it there)
    import tomli as tomllib

TABLE = Path(__file__).with_name("tasks.toml")


@dataclass(frozen=True)
class Task:
    lesson: str
    marker: str  # the pytest mark of its graders, task_<lesson>_<name>
    description: str  # its line in `minillm grade`'s table
    nudge: str  # `minillm hint` level 1
    contract: str  # level 2: a detail of the contract and the trap the grader checks
    recipe: str  # level 3: in words, never the code

    @property
    def hints(self) -> tuple[str, str, str]:
        return (self.nudge, self.contract, self.recipe)


@functools.cache
def load_tasks(path: Path = TABLE) -> tuple[Task, ...]:
    """Every task of the table, in its order; a malformed entry is a ValueError naming it (an author's typo should
    stop the import, not show up as a missing hint or an ungraded task)."""
    entries = tomllib.loads(path.read_text(encoding="utf-8")).get("task", [])
    keys = [f.name for f in fields(Task)]
    tasks, seen = [], set()
    for i, entry in enumerate(entries):
        where = f"{path.name}, task {i + 1} ({entry.get('marker', 'no marker')})"
        if sorted(entry) != sorted(keys) or not all(isinstance(v, str) and v for v in entry.values()):
            raise ValueError(f"{where}: needs exactly the non-empty strings {', '.join(keys)}; has {', '.join(entry)}")
        task = Task(**entry)
        if not task.marker.startswith(f"task_{task.lesson}_") or task.marker in seen:
            raise ValueError(f"{where}: a marker is task_<lesson>_<name> and named once")
        seen.add(task.marker)
        tasks.append(task)
    return tuple(tasks)


def tasks_by_lesson() -> dict[str, list[tuple[str, str]]]:
    """lesson -> [(task marker, description)], lessons and tasks in the table's order."""
    out: dict[str, list[tuple[str, str]]] = {}
    for task in load_tasks():
        out.setdefault(task.lesson, []).append((task.marker, task.description))
    return out
