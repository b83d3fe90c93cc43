"""The `minillm` command: generate streams text then stats; bad input is one line and exit 2; grade and bench."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from minillm.cli import main

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minillm", *args], check=False, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def _stats(line: str) -> dict[str, float]:
    """Numbers from the stats line: load, TTFT and decode seconds, tokens generated, threads."""
    def number(pattern: str) -> float:
        m = re.search(pattern, line)
        assert m, f"{pattern!r} not in {line!r}"
        return float(m.group(1))

    n = number(r"generated (\d+)")
    return {"load_s": number(r"load ([\d.]+) s"), "ttft_s": number(r"TTFT ([\d.]+) ms") / 1e3, "generated": n,
            "decode_s": (n - 1) / number(r"decode ([\d.]+) tokens/s"), "threads": number(r"(\d+) threads?,")}


def test_generate_streams_text_and_prints_stats():
    proc = run_cli("generate", "What is the capital of France?", "--max-new-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    text, _, stats = proc.stdout.rpartition("--- ")
    assert "Paris" in text  # greedy answer of the real model
    for field in ("load", "prompt", "TTFT", "tokens/s", "MBU", "finish_reason:"):
        assert field in stats, f"{field!r} missing from stats line: {stats!r}"
    assert "Traceback" not in proc.stderr


def test_generate_q4_says_what_its_matmuls_compute_in():
    """--weights q4 "in float32" does not multiply in float32: the stats say the weights' format and the
    activations' precision (int8 on minillm's CPU kernels, bf16 inside torch's where ours cannot build)."""
    proc = run_cli("generate", "Name a colour.", "--weights", "q4", "--fuse", "--max-new-tokens", "4")
    assert proc.returncode == 0, proc.stderr
    arithmetic = proc.stdout.rpartition("--- arithmetic: ")[2]
    assert "q4_1" in arithmetic and ("int8 per block of 32" in arithmetic or "bfloat16" in arithmetic), arithmetic


def test_generate_native_runs_the_native_step_and_refuses_bfloat16_with_the_reason(capsys):
    """--native with q4 weights decodes; with the float32 weights it prints eager's greedy answer and says what the
    matmuls run in; with bfloat16 it is one line, exit 2, naming what it needs."""
    from minillm.compress.quant import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("the CPU low-bit kernels did not build here")
    proc = run_cli("generate", "Name a colour.", "--weights", "q4", "--native", "--max-new-tokens", "4")
    assert proc.returncode == 0 and "decode" in proc.stdout, proc.stderr
    eager = run_cli("generate", "Name a colour.", "--max-new-tokens", "6")
    proc = run_cli("generate", "Name a colour.", "--native", "--max-new-tokens", "6")  # float32 weights as they lie
    assert proc.returncode == 0 and "native step, f32_matmul.cpp" in proc.stdout, proc.stderr
    answer = lambda out: out.partition("\n---")[0]
    assert answer(eager.stdout).strip() and answer(proc.stdout) == answer(eager.stdout)  # greedy: eager's tokens
    assert main(["generate", "hi", "--native", "--dtype", "bfloat16", "--device", "cpu", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after a load-average warning, if the machine is busy
    assert err.startswith("minillm: error: no native step") and "float32 activations" in err, err


def test_generate_prints_its_stats_right_after_the_answer(tmp_path):
    """No slow probe between the answer and the stats line, even on a machine whose probe cache is empty: the
    stats come within a small multiple of the decode time itself (a 2048^3 bf16 matmul probe once sat here for
    minutes on a CPU that emulates bf16). Threads and load are part of the stats."""
    from minillm.gguf.weights import cache_dir, gguf_path

    model_folder = gguf_path().parent
    cache = tmp_path / "cache"  # the real weights, but no measured bandwidth yet: the first-run case
    cache.mkdir()
    (cache / model_folder.name).symlink_to(model_folder)
    assert cache_dir() != cache
    env = dict(os.environ, MINILLM_CACHE=str(cache), PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "minillm", "generate", "What is the capital of France?",
                             "--max-new-tokens", "12", "--threads", "1"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    chunks = []  # (seconds since start, bytes) as they arrive
    guard = threading.Timer(180, proc.kill)  # a probe that takes minutes fails the test instead of hanging it
    guard.start()
    try:
        while data := os.read(proc.stdout.fileno(), 4096):
            chunks.append((time.monotonic() - t0, data))
        proc.wait(timeout=60)
    finally:
        guard.cancel()
    assert proc.returncode == 0, proc.stderr.read().decode()
    out = b"".join(c for _, c in chunks).decode()
    assert "Paris" in out
    stats_at = next(t for t, c in chunks if b"--- " in c)
    answered_at = max([t for t, c in chunks if t < stats_at and c.strip()] or [stats_at])
    s = _stats(out.rpartition("--- ")[2])
    assert s["threads"] == 1 and "load" in out.rpartition("--- ")[2]
    assert stats_at - answered_at < max(3.0, 3 * s["decode_s"]), (stats_at - answered_at, s)
    assert (cache / "hardware.json").exists()  # measured once, kept for the next run on this machine


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
    assert "CPU low-bit kernels:" in out  # which instruction set, or why torch's kernels are used


def test_grade_solutions_passes(capsys):
    assert main(["grade", "0", "--solutions"]) == 0  # "0" means lesson 00
    out = capsys.readouterr().out
    from minillm.course.grading import TASKS

    n = len(TASKS["00"])
    assert f"{n}/{n} tasks pass" in out and "FAIL" not in out


def test_grade_stubs_fail_with_exit_1(monkeypatch, capsys):
    import minillm.course.grading

    monkeypatch.setattr(minillm.course.grading, "run_graders",
                        lambda lesson, target: {m: "fail" for m, _ in minillm.course.grading.TASKS[lesson]})
    assert main(["grade", "00"]) == 1
    assert f"0/{len(minillm.course.grading.TASKS['00'])} tasks pass" in capsys.readouterr().out


def test_grade_without_pytest_says_what_to_install(monkeypatch, capsys):
    import minillm.course.grading

    monkeypatch.setattr(minillm.course.grading, "have_pytest", lambda: False)  # as after `pip install -e .` alone
    assert main(["grade", "00"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("minillm: error:") and "\n" not in err and "pip install" in err and "[dev]" in err, err


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["bench", "--help"]])
def test_help_documents_threads(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--threads" in out, out


@pytest.mark.parametrize("flags, named", [
    (["--weights", "int8"], "--weights"), (["--weights", "dequantized"], "--weights"),
    (["--threads", "2"], "--threads"), (["--dtype", "bfloat16"], "--dtype"), (["--cache", "contiguous"], "--cache"),
    (["--compile"], "--compile"), (["--device", "cuda"], "--device"), (["--tp", "2"], "--tp"),
])
def test_profile_edge_refuses_flags_that_say_otherwise(flags, named, capsys):
    assert main(["generate", "hi", "--profile", "edge", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("minillm: error: --profile edge") and named in err and "\n" not in err, err


def test_profile_edge_applies_one_thread_q4_fused_and_an_int8_paged_cache(monkeypatch, capsys):
    """The profile's settings reach load_model and generate (both faked: a tiny model, no weights to load); flags
    that agree with the profile are accepted."""
    import torch

    import minillm
    import minillm.measure.hardware
    from minillm.config import ModelConfig
    from minillm.model import Transformer
    from minillm.request import RequestOutput

    calls = {}

    class Tok:
        def encode_chat(self, messages):
            return [1, 5, 6, 7]

    def fake_load_model(name, **kw):
        calls["load"] = kw
        model = Transformer(ModelConfig.tiny()).eval()
        model.load_seconds = 0.01
        return model, Tok()

    def fake_generate(model, tok, prompt, **kw):
        calls["generate"] = kw
        calls["threads"] = torch.get_num_threads()
        return RequestOutput("0", [1, 5, 6, 7], [9, 10, 11], "x", "length", token_times=[0.1, 0.2, 0.3])

    monkeypatch.setattr(minillm, "load_model", fake_load_model)
    monkeypatch.setattr(minillm, "generate", fake_generate)
    monkeypatch.setattr(minillm.measure.hardware, "bandwidth", lambda device: 10e9)
    threads = torch.get_num_threads()
    try:
        assert main(["generate", "hi", "--profile", "edge", "--weights", "q4", "--fuse", "--max-new-tokens", "3"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert calls["threads"] == 1
    assert {k: calls["load"][k] for k in ("weights", "fuse", "dtype", "device")} == \
        {"weights": "q4", "fuse": True, "dtype": "float32", "device": "cpu"}
    assert calls["generate"]["cache"] == "paged" and calls["generate"]["kv_cache_dtype"] == "int8"
    stats = capsys.readouterr().out.rpartition("--- ")[0].rpartition("--- ")[2]
    assert "profile edge:" in stats and "KiB of int8 KV" in stats and "peak RSS" in stats, stats
    assert main(["generate", "hi", "--profile", "edge", "--max-new-tokens", "600"]) == 2  # past the 512-token pool
    assert "at most 512 tokens" in capsys.readouterr().err
    torch.set_num_threads(threads)
