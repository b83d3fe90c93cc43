"""The `minillm` command: generate streams text then stats; bad input is one line and exit 2; grade and bench."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from minillm.cli import main

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, MINILLM_CACHE=os.environ.get("MINILLM_CACHE", "/tmp/mlcache"))
    return subprocess.run([sys.executable, "-m", "minillm", *args], check=False, cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_generate_streams_text_and_prints_stats():
    proc = run_cli("generate", "What is the capital of France?", "--max-new-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    text, _, stats = proc.stdout.rpartition("--- ")
    assert "Paris" in text  # greedy answer of the real model
    for field in ("load", "prompt", "TTFT", "tokens/s", "MBU", "stop:"):
        assert field in stats, f"{field!r} missing from stats line: {stats!r}"
    assert "Traceback" not in proc.stderr


def test_bad_argument_exits_2_from_the_real_entry_point():
    proc = run_cli("generate", "hi", "--temperature", "-1")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "temperature" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize("argv, words", [
    (["generate", "hi", "--dtype", "int8"], ["--dtype", "int8"]),
    (["generate", "hi", "--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
    (["generate", "hi", "--max-new-tokens", "many"], ["integer"]),
    (["generate", "hi", "--top-p", "1.5"], ["top_p"]),
    (["generate", "hi", "--top-k", "-3"], ["--top-k"]),
    (["generate", "hi", "--cache", "magic"], ["--cache", "magic"]),
    (["generate", "hi", "--attn", "magic"], ["--attn"]),
    (["generate", "   "], ["prompt is empty"]),
    (["generate"], ["prompt"]),
    (["bench", "nope"], ["unknown benchmark", "decode"]),
    (["bench"], ["--list"]),
    (["grade", "42"], ["unknown lesson", "00"]),
    (["frobnicate"], ["frobnicate"]),
    ([], ["command"]),
])
def test_user_mistakes_are_one_line_and_exit_2(argv, words, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("minillm: error:") and "\n" not in err, err
    for word in words:
        assert word in err, f"{word!r} not in {err!r}"
    assert captured.out == ""


def test_bench_list(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert "decode" in out and "minillm.bench.decode:run" in out and "kv-cache" in out


def test_info_prints_config_params_and_kv_bytes(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "n_kv_heads" in out and "134,515,008" in out
    assert "46,080 bytes/token" in out and "23,040 bytes/token" in out  # 2 x 30 x 3 x 64 x {4, 2}


def test_grade_solutions_passes(capsys):
    assert main(["grade", "0", "--solutions"]) == 0  # "0" means lesson 00
    out = capsys.readouterr().out
    assert "4/4 tasks pass" in out and "FAIL" not in out


def test_grade_stubs_fail_with_exit_1(monkeypatch, capsys):
    import minillm.grading

    monkeypatch.setattr(minillm.grading, "run_graders",
                        lambda lesson, target: {m: "fail" for m, _ in minillm.grading.TASKS[lesson]})
    assert main(["grade", "00"]) == 1
    assert "0/4 tasks pass" in capsys.readouterr().out
