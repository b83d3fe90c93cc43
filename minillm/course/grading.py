"""The graded exercises: which tasks each lesson has, and `minillm grade` that runs their graders.

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
        ("task_03_speed", "speed: your tile loop within 4x of minillm's on a 512-token prefill, timed in "
                          "interleaved pairs"),
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
        ("task_06_add_norm", "RMSNorm with the residual add fused in: the sum once, float32 statistics"),
        ("task_06_static_cache", "a static KV cache: write at tensor positions, attend the whole buffer under a mask; "
                                 "a decode step that compiles once"),
        ("task_06_real_model", "SmolLM2 fused with your add_rms_norm (same logits), decoded through your static cache "
                               "with the forward compiled once: the eager tokens, one graph"),
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
        ("task_11_collectives", "the collectives of a TP forward: row-parallel all-reduce, vocabulary-parallel "
                                "embedding (masked lookup, all-reduce) and head (all-gather)"),
        ("task_11_gpipe", "the GPipe grid: stage r runs micro-batch t - r at step t, m + p - 1 steps, None idles"),
        ("task_11_real_model", "your slices and collectives shard SmolLM2 on 3 thread ranks, then 3 gloo processes: "
                               "the single-process logits and greedy tokens, Paris"),
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
    "14": [
        ("task_14_budget", "KV blocks that fit in a memory budget after the weights: K and V, every layer, the KV "
                           "heads, int8's scales, whole blocks; a budget that cannot hold one refused"),
        ("task_14_slo", "an edge SLO met on SmolLM2: your load_model / LLM keywords within its memory, serving its "
                        "sequences at once, above its quality and speed floors"),
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
