"""The graded exercises: which tasks each lesson has, and `minillm grade` that runs their graders.

Graders live in tests/graders/test_exNN_*.py, one pytest marker per task (`task_NN_name`). They import the learner's
exercises/ when MINILLM_GRADE=exercises and the reference solutions/ otherwise (see tests/graders/conftest.py).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path

# lesson -> [(task marker, what the task asks)]
TASKS: dict[str, list[tuple[str, str]]] = {
    "00": [
        ("task_00_rmsnorm", "RMSNorm in float32"),
        ("task_00_rope", "rotary position embedding (rotate-half pairing)"),
        ("task_00_attention", "causal GQA attention from scores"),
        ("task_00_sampler", "temperature, top-k, top-p sampling"),
        ("task_00_real_model", "your decoder pieces in SmolLM2: reference logits, answers Paris"),
    ],
    "01": [
        ("task_01_cache_append", "write new keys/values at the right cache positions"),
        ("task_01_cached_attention", "one decode step attending over the filled cache only"),
        ("task_01_real_model", "your KV cache decodes SmolLM2: the reference greedy tokens"),
    ],
    "02": [
        ("task_02_grouped_attention", "attention with n_kv_heads < n_heads (query head h uses KV head h // group)"),
        ("task_02_mean_pool", "GQA -> fewer KV heads by mean-pooling groups"),
        ("task_02_real_model", "your grouped attention runs SmolLM2: the reference greedy tokens"),
    ],
    "03": [
        ("task_03_merge", "merge two partial softmax results (online softmax)"),
        ("task_03_flash", "tiled flash-attention forward in torch"),
        ("task_03_real_model", "your flash attention runs SmolLM2: the reference greedy tokens"),
        ("task_03_triton", "optional: Triton flash forward, graded under the interpreter"),
    ],
    "04": [
        ("task_04_allocator", "block allocator: allocate, free, ref counts"),
        ("task_04_slots", "slot mapping: the pool slot each new token is written to, and each sequence's context "
                          "slots to read (padding: position 0, valid False)"),
        ("task_04_real_model", "your allocator and slots in generate and the engine on SmolLM2: the reference tokens"),
    ],
    "05": [
        ("task_05_schedule", "one scheduler step: admit, preempt, finish"),
        ("task_05_static_vs_continuous", "the static and continuous batching loops"),
        ("task_05_real_model", "your scheduler serves a seeded workload on SmolLM2: reference outputs"),
    ],
    "06": [
        ("task_06_qkv", "fuse the q/k/v weights into one and split the output back (GQA sizes)"),
        ("task_06_add_norm", "RMSNorm with the residual add folded in"),
        ("task_06_real_model", "your fusion on SmolLM2: same logits, same answer"),
    ],
    "07": [
        ("task_07_int8", "int8 per output row, symmetric [-127, 127], and back"),
        ("task_07_int4", "int4 per group, asymmetric (GGUF Q4_1, bit-exact), two codes per byte"),
        ("task_07_outliers", "LLM.int8(): int8 x int8 -> int32 matmul, outlier columns in float"),
        ("task_07_real_model", "your quantization of SmolLM2: int8 still says Paris, perplexity kept"),
    ],
    "08": [
        ("task_08_wanda", "Wanda scores |W| * activation norm; drop the lowest of each row (or of the matrix)"),
        ("task_08_2to4", "n:m semi-structured masks: the 2 highest of every 4 consecutive weights of a row"),
        ("task_08_drop_blocks", "remove whole blocks in place: an nn.ModuleList and a config that agree"),
        ("task_08_real_model", "your pruning of SmolLM2: Wanda 50% keeps perplexity, 2:4 everywhere, 26 blocks run"),
    ],
    "09": [
        ("task_09_loss", "T^2 * KL(teacher || student) at temperature T, stable for logits in the thousands"),
        ("task_09_schedule", "linear warm-up from step 0, then cosine decay to lr * min_lr_ratio at the last step"),
        ("task_09_step", "one training step: teacher without autograd, weighted terms, zero_grad, clip, step"),
        ("task_09_real_model", "your distillation heals SmolLM2 pruned to 20 blocks: its KL to the teacher falls"),
    ],
    "10": [
        ("task_10_greedy", "greedy verification: the drafts up to the first mismatch, then the target's own token"),
        ("task_10_rejection", "speculative sampling: accept min(1, p/q), replace from max(0, p - q): exactly p"),
        ("task_10_ngram", "prompt lookup: what followed the longest suffix's most recent earlier occurrence"),
        ("task_10_real_model", "your speculation on SmolLM2: the target's greedy tokens, most n-gram drafts accepted"),
    ],
    "11": [
        ("task_11_shard", "column- and row-parallel slices of a linear layer: concatenated / summed, they are x @ W.T"),
        ("task_11_gpipe", "the GPipe grid: stage r runs micro-batch t - r at step t, m + p - 1 steps, None idles"),
        ("task_11_real_model", "your slices shard SmolLM2 on 3 ranks: the single-process greedy tokens, Paris"),
    ],
    "12": [
        ("task_12_hash", "chained block names: SHA-256(parent + int32 ids), full blocks only, `known` continued"),
        ("task_12_match", "the longest cached prefix (stop at the first miss) and acquire: identical prefixes share"),
        ("task_12_lru", "free keeps named blocks in an LRU list; allocate: unnamed first, then least recently freed"),
        ("task_12_real_model", "your prefix cache serves SmolLM2 chats sharing a system prompt: same answers and hits"),
    ],
    "13": [
        ("task_13_pack", "pack a sequence's KV blocks into contiguous copies (partial last block, int8 scales); unpack "
                         "them into another pool's blocks, in table order"),
        ("task_13_route", "least outstanding tokens; prefix affinity: leading-run match, balance fallback, LRU memory"),
        ("task_13_real_model", "SmolLM2 prefilled on one engine, decoded on another with your transfer; your router's "
                               "choices and hits"),
    ],
}

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
    env = dict(os.environ, MINILLM_GRADE=target)
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
               "-o", "junit_family=xunit2", *map(str, files), *(extra or [])]
        subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)  # failures are outcomes
        if not xml.exists():
            raise GradingSetupError("pytest did not run; is the dev extra installed? pip install -e '.[dev]'")
        outcomes = _outcomes_by_marker(xml, files)
    return {lesson: {m: outcomes.get(m, "missing") for m, _ in TASKS[lesson]} for lesson in lessons}


# task marker -> first failure message of the last run_graders call, shown under the table as the learner's hint
LAST_FAILURES: dict[str, str] = {}


def _outcomes_by_marker(xml: Path, files: list[Path]) -> dict[str, str]:
    """Every test of a task must pass for the task to pass. Markers are read back from the test modules."""
    marker_of: dict[tuple[str, str], str] = {}  # (module, test name) -> task marker
    for f in files:
        spec = importlib.util.spec_from_file_location(f"_grader_{f.stem}", f)
        mod = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(ROOT))
        try:
            with warnings.catch_warnings():  # the task marks are registered by the graders' conftest, not here
                warnings.simplefilter("ignore")
                spec.loader.exec_module(mod)
        finally:
            sys.path.remove(str(ROOT))
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
            LAST_FAILURES.setdefault(task, failure_summary(failed.get("message") or "", failed.text or ""))
        elif case.find("skipped") is not None:
            outcome = "skip"
        else:
            outcome = "pass"
        prev = result.get(task)
        result[task] = "fail" if "fail" in (prev, outcome) else ("pass" if "pass" in (prev, outcome) else outcome)
    return result


def failure_summary(message: str, details: str = "", max_lines: int = 8) -> str:
    """The failing case in a few lines: the assertion message (which names the inputs and expected vs got), else
    the last `E ` lines of the traceback."""
    lines = [ln.rstrip() for ln in message.strip().splitlines() if ln.strip()]
    if len(lines) <= 1 and details:
        lines = [ln[1:].strip() for ln in details.splitlines() if ln.startswith("E ")] or lines
    lines = [ln[:160] for ln in lines[:max_lines]]
    return "\n".join(lines)


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
