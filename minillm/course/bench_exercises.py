"""`minillm grade NN --bench`: your exercise timed beside minillm's own, in interleaved pairs, outputs compared.

Lessons 00-05 plug into the engine (seams.use_exercises): SmolLM2 decodes (05: serves a small workload) on your
pieces, then on minillm's. Lessons 06-14 do not: CASES names the function(s) each one times, on SmolLM2's shapes,
against the minillm function that solutions/ SAME_AS names. A fast answer that differs from minillm's on the
benchmark's own inputs is reported as wrong, never as faster; an unwritten stub names the task to write first.
"""

from __future__ import annotations

import importlib
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from minillm.config import ModelConfig
from minillm.measure.harness import BenchResult
from minillm.measure.metrics import timer

ROOT = Path(__file__).resolve().parents[2]  # the checkout, which holds exercises/ and solutions/
ENGINE_LESSONS = ("00", "01", "02", "03", "04", "05")


class BenchSetupError(RuntimeError):
    """The learner's code cannot be benchmarked yet (a stub, a missing function, a raise): one line says what to do."""


@dataclass
class Context:
    """What a case builds its inputs from: the model's shapes, and (lessons 00-05) a loaded model."""

    cfg: ModelConfig = field(default_factory=ModelConfig)  # SmolLM2-135M's shapes by default
    model: Any = None  # lessons 00-05: SmolLM2 (loaded on first need) or any Transformer handed in (tests)
    tok: Any = None
    seed: int = 0

    def gen(self, offset: int = 0) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed + offset)

    def loaded(self):
        if self.model is None:
            from minillm.api import load_model

            self.model, self.tok = load_model("smollm2-135m", dtype="float32", device="cpu")
            self.cfg = self.model.config
        return self.model


@dataclass(frozen=True)
class Case:
    """One timed comparison: `make(ctx, side)` -> a no-argument call that runs it on `side` (the learner's exercise
    module, or a namespace of minillm's own functions) and returns what is compared."""

    functions: tuple[str, ...]  # the exercise names it runs (a class counts as one)
    what: str  # one timed call, in words
    make: Callable[[Context, Any], Callable[[], Any]]
    atol: float = 1e-5  # outputs compared with this tolerance (tensors, floats); the rest exactly


# ------------------------------------------------------------------------------- lessons 00-05: through the seams


def _engine_run(cache: str):
    def make(ctx: Context, side) -> Callable[[], Any]:
        from minillm.api import generate_ids
        from minillm.course.seams import use_exercises
        from minillm.sampling import SamplingParams

        model = ctx.loaded()
        prompt = (ctx.tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}]) if ctx.tok
                  else [random.Random(ctx.seed).randrange(model.config.vocab_size) for _ in range(24)])
        params = SamplingParams(max_tokens=16, ignore_eos=True)  # the same length on both sides whatever they say

        def run():
            if isinstance(side, ModuleType):
                with use_exercises(model, side):
                    return list(generate_ids(model, prompt, params, cache=cache))
            return list(generate_ids(model, prompt, params, cache=cache))
        return run
    return make


def _engine_serve(ctx: Context, side) -> Callable[[], Any]:
    from minillm.course.seams import use_exercises
    from minillm.engine import LLM
    from minillm.sampling import SamplingParams

    model = ctx.loaded()
    rng = random.Random(ctx.seed)
    requests = [([rng.randrange(model.config.vocab_size) for _ in range(rng.randint(6, 24))],
                 SamplingParams(max_tokens=rng.randint(4, 16), ignore_eos=True)) for _ in range(8)]

    def serve():
        # a pool small enough that the scheduler has to preempt, as in task_05_real_model
        llm = LLM.from_model(model, None, num_blocks=10, block_size=8, max_num_seqs=4, max_num_batched_tokens=48)
        ids = [llm.add_request(p, params) for p, params in requests]
        for _ in range(2000):
            if not llm.has_unfinished():
                return [llm.pop_output(r).token_ids for r in ids]
            llm.step()
        raise AssertionError("the engine did not finish 8 requests in 2000 steps (does a finished sequence free "
                             "its blocks? is every waiting request admitted eventually?)")

    def run():
        if isinstance(side, ModuleType):
            with use_exercises(model, side):
                return serve()
        return serve()
    return run


# ------------------------------------------------------------------------------ lessons 06-14: central functions


def _fn_case(name: str, build_args: Callable[[Context], tuple], call: Callable | None = None, number: int = 1):
    """Time `side.name(*args)` (`number` calls per timing, for functions of microseconds)."""
    def make(ctx: Context, side) -> Callable[[], Any]:
        fn = getattr(side, name)
        args = build_args(ctx)

        def run():
            for _ in range(number):
                out = call(fn, *args) if call else fn(*args)
            return out
        return run
    return make


def _weight(ctx: Context, rows: int, cols: int, offset: int = 0) -> torch.Tensor:
    """A weight matrix of the model's scale (std 0.02) with a few large entries, as trained matrices have."""
    w = torch.randn(rows, cols, generator=ctx.gen(offset)) * 0.02
    w.view(-1)[torch.randperm(w.numel(), generator=ctx.gen(offset + 1))[:rows // 8]] *= 20
    return w


def _hidden(ctx: Context, tokens: int, offset: int = 0) -> torch.Tensor:
    return torch.randn(1, tokens, ctx.cfg.dim, generator=ctx.gen(offset))


def _static_cache_step(ctx: Context, side) -> Callable[[], Any]:
    """A decode step at position 128 through every layer of a 256-slot StaticKVCache (prefilled eagerly)."""
    cfg = ctx.cfg
    cache = side.StaticKVCache(cfg, 1, 256)
    g = ctx.gen(3)
    kv = lambda n: torch.randn(1, cfg.n_kv_heads, n, cfg.head_dim, generator=g)  # noqa: E731
    cache.begin_forward(1, 128)
    for layer in range(cfg.n_layers):
        cache.attend(layer, torch.randn(1, cfg.n_heads, 128, cfg.head_dim, generator=g), kv(128), kv(128), None)
    q, k, v, pos = torch.randn(1, cfg.n_heads, 1, cfg.head_dim, generator=g), kv(1), kv(1), torch.tensor([128])

    def run():
        cache.begin_forward(1, 1, pos)
        return [cache.attend(layer, q, k, v, None) for layer in range(cfg.n_layers)][-1]
    return run


def _slices(ctx: Context, side) -> Callable[[], Any]:
    w = _weight(ctx, ctx.cfg.ffn_dim, ctx.cfg.dim)
    return lambda: (side.column_slice(w, 1, 2), side.row_slice(w, 1, 2))


def _pool(ctx: Context):
    from minillm.cache.kv_pool import KVBlockPool, KVCacheSpec

    cfg = ctx.cfg
    pool = KVBlockPool(KVCacheSpec(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, num_blocks=64, block_size=16))
    pool.k.copy_(torch.randn(pool.k.shape, generator=ctx.gen(5)))
    pool.v.copy_(torch.randn(pool.v.shape, generator=ctx.gen(6)))
    return pool


def _ids(ctx: Context, n: int, period: int = 97) -> list[int]:
    """Token ids with repeats (text quotes itself): a seeded walk over a small alphabet."""
    rng = random.Random(ctx.seed)
    return [rng.randrange(period) if rng.random() < 0.3 else i % period for i in range(n)]


def _probs(ctx: Context, rows: int, offset: int) -> torch.Tensor:
    return (torch.randn(rows, ctx.cfg.vocab_size, generator=ctx.gen(offset)) * 3).softmax(-1)


def _seeded(fn, p, q, draft):
    return fn(p, q, draft, torch.Generator().manual_seed(7))  # the same draws on both sides


# lesson -> what `--bench` runs: one row per case
CASES: dict[str, list[Case]] = {
    "00": [Case(("rms_norm", "apply_rope", "naive_attention", "sample_from_logits"),
                "16 greedy tokens of SmolLM2 on your norm, RoPE, attention and sampler", _engine_run("contiguous"))],
    "01": [Case(("append_kv", "decode_attention"), "16 greedy tokens through your KV cache",
                _engine_run("contiguous"))],
    "02": [Case(("grouped_attention",), "16 greedy tokens on your grouped attention", _engine_run("contiguous"))],
    "03": [Case(("flash_attention",), "16 greedy tokens on your flash attention (16 x 16 tiles)",
                _engine_run("contiguous"))],
    "04": [Case(("BlockAllocator", "slot_mapping", "context_slots"), "16 greedy tokens through your paged cache",
                _engine_run("paged"))],
    "05": [Case(("schedule_step", "postprocess_step"), "8 requests served by your scheduler on a 10-block pool",
                _engine_serve)],
    "06": [Case(("add_rms_norm",), "add_rms_norm over 128 tokens x dim (30 calls)",
                _fn_case("add_rms_norm", lambda c: (_hidden(c, 128), _hidden(c, 128, 1),
                                                    torch.rand(c.cfg.dim, generator=c.gen(2)) + 0.5, c.cfg.norm_eps),
                         number=30)),
           Case(("StaticKVCache",), "one decode step at position 128 through every layer's static cache",
                _static_cache_step, atol=1e-4)],
    "07": [Case(("quantize_int8",), "int8 rows of an ffn_dim x dim weight",
                _fn_case("quantize_int8", lambda c: (_weight(c, c.cfg.ffn_dim, c.cfg.dim),))),
           Case(("quantize_int4",), "int4 (Q4_1, groups of 32) of an ffn_dim x dim weight", atol=1e-6,
                make=_fn_case("quantize_int4", lambda c: (_weight(c, c.cfg.ffn_dim, c.cfg.dim), 32))),
           Case(("int8_matmul_with_outliers",), "LLM.int8() matmul of 16 tokens with outlier channels", atol=1e-3,
                make=_fn_case("int8_matmul_with_outliers", lambda c: _int8_matmul_args(c)))],
    "08": [Case(("wanda_scores",), "Wanda scores of an ffn_dim x dim weight",
                _fn_case("wanda_scores", lambda c: (_weight(c, c.cfg.ffn_dim, c.cfg.dim),
                                                    torch.rand(c.cfg.dim, generator=c.gen(9)) + 0.1))),
           Case(("semi_structured_mask",), "the 2:4 mask of an ffn_dim x dim score matrix",
                _fn_case("semi_structured_mask", lambda c: (_weight(c, c.cfg.ffn_dim, c.cfg.dim).abs(), 2, 4)))],
    "09": [Case(("distillation_loss",), "soft-target loss over 2 x 16 positions of the vocabulary, T = 2",
                _fn_case("distillation_loss", lambda c: (torch.randn(2, 16, c.cfg.vocab_size, generator=c.gen(1)),
                                                         torch.randn(2, 16, c.cfg.vocab_size, generator=c.gen(2)),
                                                         2.0)), atol=1e-4)],
    "10": [Case(("propose_ngram",), "prompt-lookup drafts of 4 tokens from a 2048-token history (20 calls)",
                _fn_case("propose_ngram", lambda c: (_ids(c, 2048), 4), number=20)),
           Case(("rejection_sample",), "exact rejection sampling of 4 drafts over the vocabulary",
                _fn_case("rejection_sample", lambda c: (_probs(c, 5, 1), _probs(c, 4, 2), [3, 1, 4, 1]),
                         call=_seeded))],
    "11": [Case(("column_slice", "row_slice"), "rank 1 of 2's slices of an ffn_dim x dim weight (both ways)",
                _slices),
           Case(("gpipe_schedule",), "the GPipe schedule of 4 stages x 32 micro-batches (50 calls)",
                _fn_case("gpipe_schedule", lambda c: (4, 32), number=50))],
    "12": [Case(("block_hashes",), "the chained hashes of a 4096-token prompt in 16-token blocks",
                _fn_case("block_hashes", lambda c: (_ids(c, 4096), 16)))],
    "13": [Case(("pack_kv_blocks",), "pack 40 blocks (625 tokens) of every layer's KV for the wire",
                _fn_case("pack_kv_blocks", lambda c: (_pool(c), list(range(63, 23, -1)), 625)))],
    "14": [Case(("kv_blocks_for_budget",), "KV blocks that fit 1 GiB beside float32 weights (200 calls)",
                _fn_case("kv_blocks_for_budget", lambda c: (c.cfg, 2**30, c.cfg.n_params() * 4, 16, "int8"),
                         number=200))],
}


def _int8_matmul_args(ctx: Context) -> tuple:
    from minillm.compress.quant import quantize_int8

    x = torch.randn(16, ctx.cfg.dim, generator=ctx.gen(4))
    x[:, :4] *= 20  # a few outlier channels, as LLM.int8() sees in real activations
    q, scale = quantize_int8(_weight(ctx, ctx.cfg.dim, ctx.cfg.dim))
    return x, q, scale, 6.0


# ----------------------------------------------------------------------------------------------------- running


def exercise_module(lesson: str, package: str) -> ModuleType:
    """exercises/exNN_*.py (or solutions/) of `lesson`, imported from the checkout."""
    files = sorted((ROOT / package).glob(f"ex{lesson}_*.py"))
    if not files:
        raise BenchSetupError(f"no {package}/ex{lesson}_*.py under {ROOT}: --bench needs the minillm checkout")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(f"{package}.{files[0].stem}")


def reference_namespace(lesson: str) -> SimpleNamespace:
    """minillm's own version of every exercise function of `lesson` (where solutions/ SAME_AS says it lives)."""
    same_as = exercise_module(lesson, "solutions").SAME_AS
    return SimpleNamespace(**{name: getattr(importlib.import_module(home), name) for name, home in same_as.items()})


def _task_of(text: Any) -> str | None:
    """'05 schedule' from a stub's message "task 05.schedule: ..."."""
    import re

    found = re.search(r"task (\d\d)\.(\w+)", str(text))
    return found and f"{found[1]} {found[2]}"


def _check_written(lesson: str, module: ModuleType, case: Case) -> None:
    from minillm.course.seams import implemented

    for name in case.functions:
        obj = getattr(module, name, None)
        if obj is None:
            raise BenchSetupError(f"{module.__name__} has no {name}, which the lesson {lesson} bench runs: is your "
                                  f"file from an older version of the course?")
        if not implemented(obj):  # the stub's message names its task
            import inspect

            task = _task_of(inspect.getsource(obj)) or lesson
            raise BenchSetupError(f"implement {name} first: minillm hint {task}")


def _guarded(run: Callable[[], Any], lesson: str, side: str) -> Callable[[], Any]:
    """`run`, with what the learner's code raises turned into one line that names it."""
    def call():
        try:
            return run()
        except NotImplementedError as e:
            raise BenchSetupError(f"implement it first ({e}): minillm hint {_task_of(e) or lesson}") from None
        except Exception as e:
            raise BenchSetupError(f"{side} raised {type(e).__name__}: {str(e)[:300]}") from None
    return call


def compare(got: Any, want: Any, atol: float, path: str = "output") -> str | None:
    """None when `got` matches `want` (tensors: shape, dtype and values within atol), else what differs first."""
    if torch.is_tensor(want):
        if not torch.is_tensor(got):
            return f"{path}: a {type(got).__name__}, expected a tensor"
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"{path}: {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} {want.dtype}"
        if want.is_floating_point():
            if torch.allclose(got, want, atol=atol, rtol=atol, equal_nan=True):
                return None
            return f"{path}: differs by up to {(got.double() - want.double()).abs().nan_to_num(float('inf')).max():.3g}"
        return None if torch.equal(got, want) else f"{path}: {int((got != want).sum())} of {want.numel()} differ"
    if isinstance(want, dict):
        if not isinstance(got, dict) or sorted(got) != sorted(want):
            return f"{path}: keys {sorted(got) if isinstance(got, dict) else type(got).__name__}, expected " \
                   f"{sorted(want)}"
        return next((d for k in want if (d := compare(got[k], want[k], atol, f"{path}[{k!r}]"))), None)
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return f"{path}: {got!r:.80}, expected {want!r:.80}"
        return next((d for i, (g, w) in enumerate(zip(got, want)) if (d := compare(g, w, atol, f"{path}[{i}]"))),
                    None)
    if isinstance(want, float):
        return None if isinstance(got, (int, float)) and abs(got - want) <= atol * (1 + abs(want)) else \
            f"{path}: {got!r}, expected {want!r}"
    return None if got == want else f"{path}: {got!r:.80}, expected {want!r:.80}"


def _described() -> dict:
    from minillm.measure.hardware import cpu_count, cpu_name, load_average

    return {"device": "cpu", "cpu": cpu_name(), "threads": torch.get_num_threads(), "cpu_count": cpu_count(),
            "load_avg": load_average(), "torch": torch.__version__}


def print_result(result: BenchResult) -> None:
    from minillm.measure.hardware import threads_line

    s = result.settings
    print(f"== lesson {s['lesson']}: {s['target']} vs minillm's own, {s['pairs']} interleaved pairs; {threads_line()}")
    print(result.table())
    for note in result.notes:
        print(f"  note: {note}")


def interleaved(fn: Callable[[], Any], reference: Callable[[], Any], pairs: int) -> tuple[list[float], list[float]]:
    """Seconds of `fn` and of `reference` over `pairs` back-to-back pairs, the order alternating (A B, B A, ...):
    a machine that slows down mid-run slows both halves of a pair, so the per-pair ratio stays honest."""
    mine, ref = [], []
    for i in range(pairs):
        for which, f in (((mine, fn), (ref, reference)) if i % 2 == 0 else ((ref, reference), (mine, fn))):
            with timer() as t:
                f()
            which.append(t.seconds)
    return mine, ref


def bench_lesson(lesson: str, target: str = "exercises", pairs: int = 5, ctx: Context | None = None,
                 module: ModuleType | None = None) -> BenchResult:
    """Every case of `lesson`: the outputs of `target`'s code (exercises/ or solutions/; `module` instead, if given)
    against minillm's on the same inputs, then `pairs` interleaved timings. Raises BenchSetupError (one line) for a
    stub or a raise. The result's hardware is described, not probed (the probes take seconds; `minillm bench`)."""
    if lesson not in CASES:
        raise ValueError(f"no --bench for lesson {lesson!r}; lessons: {', '.join(CASES)}")
    if pairs < 1:
        raise ValueError(f"--pairs must be >= 1, got {pairs}")
    ctx = ctx or Context()
    module, reference = module or exercise_module(lesson, target), reference_namespace(lesson)
    result = BenchResult(name=f"grade-bench-{lesson}", quick=True, hardware=_described(),
                         settings={"lesson": lesson, "target": module.__name__, "pairs": pairs,
                                   "threads": torch.get_num_threads()})
    for case in CASES[lesson]:
        _check_written(lesson, module, case)
        label = ", ".join(case.functions)
        mine = _guarded(case.make(ctx, module), lesson, f"your {label}")
        ref = _guarded(case.make(ctx, reference), lesson, f"minillm's {label}")
        with torch.inference_mode():
            got, want = mine(), ref()  # also the warm-up: first calls pay for allocations and lazy imports
            wrong = compare(got, want, case.atol)
            t_mine, t_ref = interleaved(mine, ref, pairs)
        ratios = sorted(a / max(b, 1e-9) for a, b in zip(t_mine, t_ref))
        result.rows.append({"function": label, "what": case.what, "reference_ms": statistics.median(t_ref) * 1e3,
                            "yours_ms": statistics.median(t_mine) * 1e3, "ratio": statistics.median(ratios),
                            "ratio_min": ratios[0], "ratio_max": ratios[-1],
                            "output": "matches" if wrong is None else "WRONG"})
        result.ratios[f"{label} yours/minillm"] = statistics.median(ratios)
        if wrong:
            result.notes.append(f"{label}: your output differs from minillm's on the bench's inputs ({wrong}); "
                                f"its time says nothing until it matches: minillm grade {lesson}")
    result.notes.append(f"ratio = your time / minillm's, per interleaved pair (median, min, max over {pairs}); "
                        f"> 1 is slower than minillm")
    return result
