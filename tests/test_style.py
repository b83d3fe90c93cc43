"""House style that a tool can hold: no line past pyproject's line-length (ruff's E501), in every Python file."""

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
