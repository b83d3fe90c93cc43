"""House style that a tool can hold: no line past pyproject's line-length (ruff's E501), in every Python file;
no module docstring in minillm/ or kernels/ longer than 8 lines."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_no_line_is_longer_than_the_declared_width():
    pytest.importorskip("ruff")  # the dev extra installs it
    folders = ["minillm", "kernels", "lessons", "exercises", "solutions", "tests", "scripts"]
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "E501", "--output-format", "concise",
                          "--no-cache", "--extend-exclude", "*.ipynb", *folders],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, f"lines past pyproject's [tool.ruff] line-length:\n{run.stdout[-4000:]}{run.stderr}"


MODULE_DOCSTRING_MAX_LINES = 8  # the idea, the cost it removes, the lesson; detail goes to functions/classes


def _module_docstring_lines(source: str) -> int | None:
    """Lines of a module's top docstring, first to last non-empty line; None when it has none."""
    doc = ast.get_docstring(ast.parse(source), clean=False)
    return None if doc is None else len(doc.strip("\n").splitlines())


def test_the_docstring_counter_sees_a_long_module_docstring():
    nine = '"""' + "\n".join(f"line {i}" for i in range(1, 10)) + '\n"""\n\nX = 1\n'
    assert _module_docstring_lines(nine) == 9
    assert _module_docstring_lines('\n"""One line."""\nX = 1\n') == 1
    assert _module_docstring_lines("X = 1\n") is None


def test_module_docstrings_are_short():
    over = []
    for folder in ["minillm", "kernels"]:
        for path in sorted((ROOT / folder).rglob("*.py")):
            n = _module_docstring_lines(path.read_text(encoding="utf-8"))
            if n is not None and n > MODULE_DOCSTRING_MAX_LINES:
                over.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not over, (f"module docstrings over {MODULE_DOCSTRING_MAX_LINES} lines (say the idea, the cost it removes "
                      "and the lesson; move detail to the functions/classes it describes):\n" + "\n".join(over))
