"""Graders must be able to fail: every task fails on the stubs in exercises/ and passes on solutions/.

That the solutions pass is shown by the default test run itself, which collects tests/graders against solutions/
(a failing task there fails CI); running them a second time here would double the graders' share of CI time.
`minillm grade NN --solutions` is the same check by hand."""

from __future__ import annotations

import pytest

from minillm.course.grading import ROOT, TASKS, run_graders_of

LESSONS = [lesson for lesson in TASKS if list((ROOT / "tests" / "graders").glob(f"test_ex{lesson}_*.py"))]


def test_stubs_fail():
    """Every lesson's graders on the stubs, in one pytest process (one interpreter start and one model load instead
    of one per lesson): each task must fail."""
    outcomes = run_graders_of(LESSONS, "exercises")
    passing = [f"{task} ({outcomes[lesson].get(task)})" for lesson in LESSONS for task, what in TASKS[lesson]
               if outcomes[lesson].get(task) not in (("fail", "skip") if what.startswith("optional") else ("fail",))]
    assert not passing, f"tasks that do not fail on the stubs (their graders cannot fail): {passing}"


# ------------------------------------------------------------------------------------------- the mutant list

from tests.graders.mutants import MUTANTS  # noqa: E402

MUTANT_LESSONS = sorted({m.lesson for m in MUTANTS})
# the mutants of the real-model tasks load and run SmolLM2 (5-30 s each, ~150 s in all): a slow test of their own;
# the default run still shows that every real-model grader passes the solution and fails the stub
REAL_MODEL_MUTANT_LESSONS = sorted({m.lesson for m in MUTANTS if m.real_model})
OTHER_MUTANT_LESSONS = sorted({m.lesson for m in MUTANTS if not m.real_model})


def test_every_task_has_a_mutant():
    covered = {m.task for m in MUTANTS}
    required = {task for lesson in MUTANT_LESSONS for task, what in TASKS[lesson] if not what.startswith("optional")}
    assert required <= covered, f"tasks without a mutant in tests/graders/mutants.py: {sorted(required - covered)}"


def _assert_mutants_killed(lessons: list[str], real_model: bool) -> None:
    import json
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "tests.graders.mutants", ",".join(lessons),
                           "--real-model" if real_model else "--no-real-model"], cwd=ROOT, capture_output=True,
                          text=True, timeout=1800, env={**os.environ, "MINILLM_GRADE": "solutions"})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("MUTANTS ")), None)
    assert line is not None, f"the mutant runner failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = json.loads(line[len("MUTANTS "):])
    expected = {f"{m.lesson}:{m.name}" for m in MUTANTS if m.lesson in lessons and m.real_model == real_model}
    assert set(results) == expected
    survivors = [name for name, outcome in results.items() if outcome != "killed"]
    assert not survivors, f"mutants that pass their task's graders (strengthen the grader): {survivors}"


# three processes for all lessons (one each would pay an interpreter start and the imports 13 times), so that
# the two CI workers share them
MUTANT_GROUPS = [OTHER_MUTANT_LESSONS[i::3] for i in range(3)]


@pytest.mark.parametrize("lessons", MUTANT_GROUPS, ids=[",".join(g) for g in MUTANT_GROUPS])
def test_every_mutant_fails_its_task(lessons):
    """Each committed mutant (a solution with one known bug edited in) makes its task's graders fail (by hand:
    python -m tests.graders.mutants NN); the real-model tasks' ones: test_every_real_model_mutant_fails_its_task."""
    _assert_mutants_killed(lessons, real_model=False)


@pytest.mark.slow
@pytest.mark.parametrize("lesson", REAL_MODEL_MUTANT_LESSONS)
def test_every_real_model_mutant_fails_its_task(lesson):
    """The mutants of task_NN_real_model: each makes SmolLM2 run wrong through the learner's code, and the task
    fails."""
    _assert_mutants_killed([lesson], real_model=True)


# ------------------------------------------------------------------------- importing the reference must fail

CHEATS = {
    "ex05_import_from_engine": ("schedule_step",
                                "from minillm.engine.scheduler import schedule_step, postprocess_step\n"),
    "ex05_import_package": ("schedule_step",
                            "from minillm.engine import scheduler as _s\n\n"
                            "def schedule_step(waiting, running, block_manager, max_num_seqs, "
                            "max_num_batched_tokens):\n"
                            "    return _s.schedule_step(waiting, running, block_manager, max_num_seqs,\n"
                            "                            max_num_batched_tokens)\n"),
    "ex00_alias": ("rms_norm", "from minillm.model import rms_norm as _a\n\n"
                               "def rms_norm(x, weight, eps):\n    return _a(x, weight, eps)\n"),
    "ex00_alias_in_helper": ("naive_attention",
                             "from minillm.attention import naive_attention as _ref\n\n"
                             "def _helper(q, k, v, causal):\n    return _ref(q, k, v, causal)\n\n"
                             "def naive_attention(q, k, v, causal=True):\n    return _helper(q, k, v, causal)\n"),
    "ex09_module_alias": ("train_step", "import minillm.compress.distill as _d\n\n"
                                        "def train_step(student, teacher, x, optimizer, cfg):\n"
                                        "    return _d.train_step(student, teacher, x, optimizer, cfg)\n"),
    "ex03_solution_alias": ("flash_attention", "import solutions.ex03_flash as _sol\n\n"
                                               "def flash_attention(q, k, v, causal=True, block_q=64, block_k=64):\n"
                                               "    return _sol.flash_attention(q, k, v, causal, block_q, block_k)\n"),
}


@pytest.mark.parametrize("cheat", sorted(CHEATS))
def test_importing_the_reference_fails(cheat, tmp_path):
    import importlib.util

    from tests.graders.conftest import TARGET, forbid_calls

    name, source = CHEATS[cheat]
    path = tmp_path / f"{cheat}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"{TARGET}._cheat_{cheat}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(pytest.fail.Exception, match="import|comes from"):
        forbid_calls(getattr(module, name), ["scaled_dot_product_attention"])


def test_solutions_are_not_flagged():
    import importlib

    from tests.graders.conftest import forbid_reference_imports
    for module in sorted(p.stem for p in (ROOT / "solutions").glob("ex[0-9][0-9]_*.py")):
        sol = importlib.import_module(f"solutions.{module}")
        for name in sol.SAME_AS:
            forbid_reference_imports(getattr(sol, name))
