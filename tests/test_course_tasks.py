"""minillm/course/tasks.toml, the course's one table of tasks: grading's list and the hints are read from it."""

import pytest

from minillm.course.tasks import load_tasks, tasks_by_lesson


def test_grading_and_hints_read_the_same_table_in_its_order():
    from minillm.course.grading import TASKS
    from minillm.course.hints import HINTS

    tasks = load_tasks()
    assert [m for lesson in TASKS.values() for m, _ in lesson] == [t.marker for t in tasks]
    assert TASKS == tasks_by_lesson() and list(TASKS) == sorted(TASKS)
    assert HINTS == {t.marker: (t.nudge, t.contract, t.recipe) for t in tasks}


@pytest.mark.parametrize("entry, complaint", [
    ('lesson = "00"\nmarker = "task_00_x"\ndescription = "d"\nnudge = "n"\ncontract = "c"\n', "needs exactly"),
    ('lesson = "00"\nmarker = "task_00_x"\ndescription = "d"\nnudge = ""\ncontract = "c"\nrecipe = "r"\n',
     "non-empty"),
    ('lesson = "01"\nmarker = "task_00_x"\ndescription = "d"\nnudge = "n"\ncontract = "c"\nrecipe = "r"\n',
     "task_<lesson>_<name>"),
])
def test_a_malformed_task_stops_the_load_and_is_named(tmp_path, entry, complaint):
    table = tmp_path / "tasks.toml"
    table.write_text(f"[[task]]\n{entry}")
    with pytest.raises(ValueError, match=complaint) as err:
        load_tasks(table)
    assert "task_00_x" in str(err.value)
