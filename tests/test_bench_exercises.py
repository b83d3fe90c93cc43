"""`minillm grade NN --bench`: the learner's code timed beside minillm's, outputs compared (course/bench_exercises.py).

Cheap: lessons whose cases run on a tiny config or on pure arithmetic; SmolLM2 is loaded only by the slow test.
"""

from __future__ import annotations

import json
from types import ModuleType

import pytest
import torch

from minillm.cli import main
from minillm.config import ModelConfig
from minillm.course.bench_exercises import CASES, BenchSetupError, Context, bench_lesson, compare, exercise_module
from minillm.course.tasks import tasks_by_lesson

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny() -> Context:
    return Context(cfg=ModelConfig.tiny())


def test_every_lesson_with_exercises_has_a_bench():
    assert sorted(CASES) == sorted(tasks_by_lesson())
    for lesson, cases in CASES.items():
        solutions = exercise_module(lesson, "solutions")
        for case in cases:
            missing = [f for f in case.functions if f not in solutions.SAME_AS]
            assert not missing, f"lesson {lesson}'s bench names {missing}, which solutions/ does not mirror"


@pytest.mark.parametrize("lesson", ["07", "12", "14"])
def test_solutions_match_and_time_like_minillm(lesson):
    result = bench_lesson(lesson, "solutions", pairs=3, ctx=tiny())
    assert len(result.rows) == len(CASES[lesson])
    for row in result.rows:
        assert row["output"] == "matches", row
        # the same code on both sides: the median ratio is noise around 1 (wide bounds: a shared 2-core machine)
        assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"] and 0.33 < row["ratio"] < 3, row


def _copy_of(module: ModuleType, **replace) -> ModuleType:
    out = ModuleType(module.__name__)
    vars(out).update(vars(module))
    vars(out).update(replace)
    return out


def _int8_scale_over_128(w):
    """Wrong: a scale of max/128, so every code is off by a little."""
    wf = w.float()
    scale = wf.abs().amax(dim=1).clamp_min(1e-12) / 128
    return (wf / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def _int8_fast_and_wrong(w):
    """Wrong and faster than anything: zeros."""
    return torch.zeros(w.shape, dtype=torch.int8), torch.ones(w.shape[0])


@pytest.mark.parametrize("wrong", [_int8_scale_over_128, _int8_fast_and_wrong])
def test_a_wrong_answer_is_reported_wrong_not_faster(wrong):
    module = _copy_of(exercise_module("07", "solutions"), quantize_int8=wrong)
    result = bench_lesson("07", pairs=1, ctx=tiny(), module=module)
    rows = {r["function"]: r for r in result.rows}
    assert rows["quantize_int8"]["output"] == "WRONG"
    assert rows["quantize_int4"]["output"] == "matches"
    assert any("quantize_int8: your output differs" in n and "says nothing" in n for n in result.notes)


def test_a_stub_names_the_task_to_write_first():
    with pytest.raises(BenchSetupError, match=r"^implement block_hashes first: minillm hint 12 hash$"):
        bench_lesson("12", "exercises", pairs=1, ctx=tiny())


def test_a_raise_in_the_learners_code_is_one_line():
    def broken(w):
        raise IndexError("off by one")

    module = _copy_of(exercise_module("07", "solutions"), quantize_int8=broken)
    with pytest.raises(BenchSetupError, match="your quantize_int8 raised IndexError: off by one"):
        bench_lesson("07", pairs=1, ctx=tiny(), module=module)


def test_compare_names_what_differs():
    a = torch.arange(6.0).reshape(2, 3)
    assert compare(a, a.clone(), 1e-6) is None
    assert "(2, 3) torch.float64" in compare(a.double(), a, 1e-6)
    assert "differs by up to 0.5" in compare(a + torch.tensor([0, 0, 0.5]), a, 1e-6)
    assert compare({"k": [1, 2]}, {"k": [1, 3]}, 0) == "output['k'][1]: 2, expected 3"
    assert compare((a, 1.0), (a, 1.0 + 1e-9), 1e-6) is None


def test_cli_bench_solutions_writes_json(tmp_path, capsys):
    path = tmp_path / "b.json"
    assert main(["grade", "14", "--bench", "--solutions", "--pairs", "2", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "kv_blocks_for_budget" in out and "matches" in out and f"wrote {path}" in out
    saved = json.loads(path.read_text())
    assert saved["rows"][0]["output"] == "matches" and saved["settings"]["pairs"] == 2


def test_cli_bench_on_a_stub_is_one_line_exit_1(capsys):
    assert main(["grade", "12", "--bench", "--pairs", "1", "--json", "/dev/null"]) == 1
    err = capsys.readouterr().err.strip().splitlines()  # a busy machine adds use_threads' load warning before it
    assert err[-1] == "minillm grade 12 --bench: implement block_hashes first: minillm hint 12 hash", err
    assert all(line.startswith("minillm") for line in err), err  # no traceback


def test_cli_pairs_needs_bench(capsys):
    assert main(["grade", "14", "--pairs", "3"]) == 2
    assert "--bench" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("lesson", ["00", "05"])
def test_engine_lessons_on_smollm2(lesson):
    """Through the seams: SmolLM2 on solutions/ pieces gives minillm's tokens."""
    result = bench_lesson(lesson, "solutions", pairs=2)
    assert [r["output"] for r in result.rows] == ["matches"], result.rows
