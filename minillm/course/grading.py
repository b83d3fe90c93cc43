"""`minillm grade NN`: run a lesson's graders, one outcome per task of the course's table (tasks.toml).

Graders live in tests/graders/test_exNN_*.py, one pytest marker per task (`task_NN_name`). They import the learner's
exercises/ when MINILLM_GRADE=exercises and the reference solutions/ otherwise (see tests/graders/conftest.py).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path

from minillm.course.tasks import tasks_by_lesson

# lesson -> [(task marker, what the task asks)], from the course's one table of tasks (tasks.toml)
TASKS: dict[str, list[tuple[str, str]]] = tasks_by_lesson()

ROOT = Path(__file__).resolve().parents[2]  # the checkout: minillm/course/grading.py


class GradingSetupError(RuntimeError):
    """Grading cannot run on this install (pytest missing, graders not found); the message says what to do."""


def have_pytest() -> bool:
    return importlib.util.find_spec("pytest") is not None


def all_markers() -> list[tuple[str, str]]:
    return [t for tasks in TASKS.values() for t in tasks]


def run_graders(lesson: str, target: str = "exercises", extra: list[str] | None = None) -> dict[str, str]:
    """Run lesson's graders against `target` ('exercises' or 'solutions'); {task marker: 'pass' | 'fail' | 'skip'}."""
    return run_graders_of([lesson], target, extra)[lesson]


def run_graders_of(lessons: list[str], target: str = "exercises", extra: list[str] | None = None
                   ) -> dict[str, dict[str, str]]:
    """Several lessons' graders in one pytest process (one interpreter start, one model load):
    {lesson: {task marker: 'pass' | 'fail' | 'skip' | 'missing'}}."""
    unknown = [lesson for lesson in lessons if lesson not in TASKS]
    if unknown:
        raise ValueError(f"unknown lesson {unknown[0]!r}; lessons with exercises: {', '.join(TASKS)}")
    if not have_pytest():
        raise GradingSetupError("minillm grade runs the graders with pytest, which is not installed here: "
                                "python -m pip install -e '.[dev]' in the minillm checkout")
    files = sorted(f for lesson in lessons for f in (ROOT / "tests" / "graders").glob(f"test_ex{lesson}_*.py"))
    if not files:
        raise GradingSetupError(f"no graders for lesson(s) {', '.join(lessons)} under {ROOT / 'tests' / 'graders'}: "
                                f"grading needs the minillm checkout (git clone, then pip install -e '.[dev]')")
    outcomes = _grade_files(files, dict(os.environ, MINILLM_GRADE=target), ROOT, extra)
    return {lesson: {m: outcomes.get(m, "missing") for m, _ in TASKS[lesson]} for lesson in lessons}


# task marker -> the first failure of the last run_graders call (which test, what it checked or what raised), shown
# under the table as the learner's hint
LAST_FAILURES: dict[str, str] = {}


def _grade_files(files: list[Path], env: dict[str, str], cwd: Path, extra: list[str] | None = None) -> dict[str, str]:
    """Run pytest on grader `files` in a subprocess; {task marker: outcome}, the first failure of each task in
    LAST_FAILURES. Native tracebacks: one `File "...", line N, in fn` per frame, so a failure can name the learner's
    function that raised."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=native", f"--junitxml={xml}",
               "-o", "junit_family=xunit2", *map(str, files), *(extra or [])]
        subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)  # failures are outcomes
        if not xml.exists():
            raise GradingSetupError("pytest did not run; is the dev extra installed? pip install -e '.[dev]'")
        return _outcomes_by_marker(xml, files)


def _outcomes_by_marker(xml: Path, files: list[Path]) -> dict[str, str]:
    """Every test of a task must pass for the task to pass. Markers are read back from the test modules."""
    marker_of: dict[tuple[str, str], str] = {}  # (module, test name) -> task marker
    for f in files:
        spec = importlib.util.spec_from_file_location(f"_grader_{f.stem}", f)
        mod = importlib.util.module_from_spec(spec)
        paths = [str(ROOT), str(f.parent)]
        sys.path[:0] = paths
        try:
            with warnings.catch_warnings():  # the task marks are registered by the graders' conftest, not here
                warnings.simplefilter("ignore")
                spec.loader.exec_module(mod)
        finally:
            for p in paths:
                sys.path.remove(p)
        for name, obj in vars(mod).items():
            for mark in getattr(obj, "pytestmark", []):
                if mark.name.startswith("task_"):
                    marker_of[(f.stem, name)] = mark.name
    result: dict[str, str] = {}
    LAST_FAILURES.clear()
    for case in ET.parse(xml).getroot().iter("testcase"):
        base = case.get("name", "").split("[")[0]
        task = marker_of.get((case.get("classname", "").rsplit(".", 1)[-1], base))
        if task is None:
            continue
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        if failed is not None:
            outcome = "fail"
            LAST_FAILURES.setdefault(task, failure_summary(failed.get("message") or "", failed.text or "",
                                                           test=case.get("name", "")))
        elif case.find("skipped") is not None:
            outcome = "skip"
        else:
            outcome = "pass"
        prev = result.get(task)
        result[task] = "fail" if "fail" in (prev, outcome) else ("pass" if "pass" in (prev, outcome) else outcome)
    return result


# pytest's advice to its own user ("Use -v to get more diff", "use '-vv' to show"): a `minillm grade` user cannot
# pass -v, and the message already says what differs
_PYTEST_ADVICE = re.compile(r"use '?-v+'? to (get|see|show)|full output truncated", re.IGNORECASE)
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)\n(?P<src>[^\n]*)', re.MULTILINE)
_ASSERTION = ("AssertionError", "Failed")  # a grader's check (assert, pytest.fail), as opposed to a raise


def _frames(details: str) -> list[tuple[str, int, str, str]]:
    """(path, line, function, source line) of each frame of a native traceback, outermost first."""
    return [(m["path"], int(m["line"]), m["fn"], m["src"].strip()) for m in _FRAME.finditer(details)]


def _is_learner(path: str) -> bool:
    return Path(path).parent.name in ("exercises", "solutions")


def failure_summary(message: str, details: str = "", test: str = "", max_lines: int = 40) -> str:
    """The failing case, whole: the grader's assertion message (its inputs, expected vs got) without pytest's advice
    to its own user. When the graded code raised instead, which call of the test raised what, and where in the
    learner's file."""
    exc_type, sep, rest = message.partition(": ")
    raised = sep and re.fullmatch(r"[\w.]+", exc_type) and exc_type.rsplit(".", 1)[-1] not in _ASSERTION
    if sep and not raised and exc_type.rsplit(".", 1)[-1] in _ASSERTION:
        message = rest  # "AssertionError: " says nothing the message does not
    lines = [ln.rstrip() for ln in message.strip().splitlines() if ln.strip() and not _PYTEST_ADVICE.search(ln)]
    if not lines and details:  # no message at all: the last lines of the traceback
        lines = [ln.strip() for ln in details.strip().splitlines()[-3:]]
    if raised:
        lines[:1] = _raised(exc_type, rest.splitlines()[0] if rest else "", _frames(details))
    if test:
        lines.insert(0, f"{test}:")
    if len(lines) > max_lines:
        lines = lines[:max_lines] + [f"... ({len(lines) - max_lines} more lines)"]
    return "\n".join(lines)


def _raised(exc_type: str, text: str, frames: list[tuple[str, int, str, str]]) -> list[str]:
    """What raised, where in the learner's file, and the grader's call that led there."""
    mine = [i for i, f in enumerate(frames) if _is_learner(f[0])]
    if not mine:
        head = [f"{exc_type} raised: {text}"]
        where = [f for f in frames[-1:] if not Path(f[0]).name.startswith("test_")]  # inside minillm or torch
    else:
        _, _, fn, _ = frames[mine[-1]]
        stub = exc_type == "NotImplementedError"
        head = [f"your {fn} is not written yet: {text}" if stub else f"your {fn} raised {exc_type}: {text}"]
        where = [] if stub else [frames[mine[-1]]]
    out = head + [f"  at {Path(p).parent.name}/{Path(p).name}:{line}: {src}" for p, line, _, src in where]
    first = mine[0] if mine else len(frames)
    calls = [f for f in frames[:first] if Path(f[0]).name.startswith("test_")]
    if calls:
        out.append(f"  the grader's call: {calls[-1][3]}")
    return out


def print_table(lesson: str, outcomes: dict[str, str], target: str) -> None:
    print(f"lesson {lesson} graded against {target}/")
    width = max(len(m) for m in outcomes)
    for (marker, what) in TASKS[lesson]:
        print(f"  {outcomes[marker].upper():5s}  {marker:<{width}s}  {what}")
        if outcomes[marker] == "fail" and LAST_FAILURES.get(marker):
            first, *rest = LAST_FAILURES[marker].splitlines()
            print(f"         {'':<{width}s}  -> {first}")
            for line in rest:
                print(f"         {'':<{width}s}     {line}")
    n_pass = sum(v == "pass" for v in outcomes.values())
    print(f"  {n_pass}/{len(outcomes)} tasks pass")
