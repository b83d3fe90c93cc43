"""The seams the course patches: SmolLM2-135M run on the learner's own exercise code (`minillm grade 00` to `05`).

`use_exercises(model, exercises.ex00_decoder, ...)` plugs each piece into a seam the engine has (`SEAMS`):
  ex00  rms_norm, apply_rope -> minillm.model; naive_attention -> registry; sample_from_logits -> generate
  ex01  a KVCache writing with append_kv, decoding with decode_attention -> minillm.kv_cache.KVCache
  ex02, ex03  grouped_attention, flash_attention (16 x 16 tiles) as the dense attention backend -> registry
  ex04  BlockAllocator -> engine.llm, cache.paged; slot_mapping, context_slots -> cache.paged_attention
  ex05  schedule_step and postprocess_step of the engine's Scheduler -> minillm.engine.scheduler
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from types import ModuleType

import minillm.attention as attention
import minillm.cache.paged as paged
import minillm.cache.paged_attention as paged_attention
import minillm.decode_loop as decode_loop
import minillm.engine.llm as llm
import minillm.engine.scheduler as scheduler
import minillm.kv_cache as kv_cache
import minillm.model as model_mod
import minillm.sampling as sampling

# the order lessons build the engine in
LADDER = ["ex00_decoder", "ex01_kv_cache", "ex02_gqa", "ex03_flash", "ex04_paged", "ex05_batching"]
# what each real-model task runs underneath its own exercise: the earlier pieces on its path. ex02/ex03 leave ex01's
# cache out so that their attention serves the decode steps too (ex01's decode_attention would take those over); the
# contiguous cache is not on the paged path of ex04/ex05, whose prefill (and equal-length decode) runs the model's dense
# backend: of the dense attentions the latest one written serves.
STANDS_ON: dict[str, list[str]] = {
    "ex00_decoder": [],
    "ex01_kv_cache": ["ex00_decoder"],
    "ex02_gqa": ["ex00_decoder"],
    "ex03_flash": ["ex00_decoder"],
    "ex04_paged": ["ex00_decoder", "ex02_gqa", "ex03_flash"],
    "ex05_batching": ["ex00_decoder", "ex02_gqa", "ex03_flash", "ex04_paged"],
}
DENSE_ATTENTION = {"naive_attention", "grouped_attention", "flash_attention"}

# exercise module -> the names it plugs in (a class counts as one piece)
PIECES: dict[str, list[str]] = {
    "ex00_decoder": ["rms_norm", "apply_rope", "naive_attention", "sample_from_logits"],
    "ex01_kv_cache": ["append_kv", "decode_attention"],
    "ex02_gqa": ["grouped_attention"],
    "ex03_flash": ["flash_attention"],
    "ex04_paged": ["BlockAllocator", "slot_mapping", "context_slots"],
    "ex05_batching": ["schedule_step", "postprocess_step"],
}


# piece -> the module globals it replaces: the engine calls these names through their modules, so patching the
# global swaps the learner's function in everywhere. Real imports: a moved module breaks this table loudly.
SEAMS: dict[str, list[tuple[ModuleType, str]]] = {
    "rms_norm": [(model_mod, "rms_norm")],  # Transformer's blocks call the module-level functions
    "apply_rope": [(model_mod, "apply_rope")],
    "sample_from_logits": [(decode_loop, "sample_from_logits"), (sampling, "sample_from_logits")],
    "append_kv": [(kv_cache, "append_kv")],  # KVCache.attend writes through the module-level function
    # the engine builds its allocator (its BlockManager and its cache share it); any other PagedKVCache
    # (generate's, the static baseline's, the drafter's) builds its own
    "BlockAllocator": [(llm, "BlockAllocator"), (paged, "BlockAllocator")],
    # AttentionMetadata.build (write slots) and StepPlan.build (read slots) call the module globals
    "slot_mapping": [(paged_attention, "slot_mapping")],
    "context_slots": [(paged_attention, "context_slots")],
    # Scheduler.schedule / postprocess call the module-level functions
    "schedule_step": [(scheduler, "schedule_step")],
    "postprocess_step": [(scheduler, "postprocess_step")],
}


def _is_stub_function(fn) -> bool:
    """True if fn's body (after its docstring) is only `raise NotImplementedError(...)`."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    if not tree.body or not isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False  # a lambda, a partial: written by someone
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    return len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.unparse(body[0])


def implemented(obj) -> bool:
    """Has the learner written this piece? A class counts as written when none of its methods is still a stub."""
    if inspect.isclass(obj):
        return not any(_is_stub_function(f) for f in vars(obj).values() if inspect.isfunction(f))
    return not _is_stub_function(obj)


def module_key(module: ModuleType) -> str:
    key = module.__name__.rsplit(".", 1)[-1]
    if key not in PIECES:
        raise ValueError(f"{module.__name__} is not an exercise module of the ladder ({', '.join(PIECES)})")
    return key


def pieces(module: ModuleType, skip_stubs: bool = False) -> list[str]:
    """The names `module` plugs in (only the written ones with skip_stubs)."""
    names = PIECES[module_key(module)]
    return [n for n in names if not skip_stubs or implemented(getattr(module, n))]


@contextmanager
def use_exercises(model, *modules: ModuleType, skip_stubs: bool = False, only: set[str] | None = None
                  ) -> Iterator[list[str]]:
    """Route `model` (and the caches and engines built while the block runs) through the exercise modules' functions.

    Yields the pieces swapped in, as "exNN_topic.name". Everything is restored on exit, the model's attention backend
    included. Later modules win where two plug into the same seam (the dense attention backend). `only` limits the
    swap to those names (one piece at a time, to find which one breaks the model)."""
    used: list[str] = []
    with ExitStack() as stack:
        def patch(owner, name: str, value) -> None:
            old = getattr(owner, name)
            setattr(owner, name, value)
            stack.callback(setattr, owner, name, old)

        def attention_backend(name: str, fn: Callable, kind: str = "dense") -> None:
            attention.register_attention(name, fn, kind=kind, doc="the learner's exercise (minillm.course.seams)")
            stack.callback(attention._REGISTRY.pop, name, None)
            if kind == "dense":
                old = model.attn_backend
                model.attn_backend = name
                stack.callback(setattr, model, "attn_backend", old)

        for module in modules:
            key = module_key(module)
            # skip_stubs: leave out what is still the stub's `raise NotImplementedError`; the reference fills in
            for name in pieces(module, skip_stubs):
                if only is not None and name not in only:
                    continue
                fn = getattr(module, name)
                used.append(f"{key}.{name}")
                if name in SEAMS:
                    for owner, attr in SEAMS[name]:
                        patch(owner, attr, fn)
                elif name in ("naive_attention", "grouped_attention"):
                    attention_backend(f"exercise_{key}", fn)
                elif name == "flash_attention":  # small tiles, so a short prompt still spans several of them
                    attention_backend(f"exercise_{key}", functools.partial(fn, block_q=16, block_k=16))
                elif name == "decode_attention":  # the class the front door's make_cache builds
                    patch(kv_cache, "KVCache", _cache_with_decode(kv_cache.KVCache, fn))
        yield used


def _cache_with_decode(base: type, decode_attention: Callable) -> type:
    """A KVCache class whose decode steps (one new token) attend with `decode_attention` over the filled cache."""

    class ExerciseKVCache(base):
        def attend(self, layer_id, q, k, v, attn):
            if q.shape[2] != 1:
                return super().attend(layer_id, q, k, v, attn)  # prefill: the model's dense backend
            end = kv_cache.append_kv(self.k[layer_id], self.v[layer_id], k, v, self.start)
            return decode_attention(q, self.k[layer_id], self.v[layer_id], end)

    return ExerciseKVCache


def earlier_modules(key: str, package: str) -> list[ModuleType]:
    """The exercise modules `key` stands on (STANDS_ON), imported from `package` (exercises or solutions)."""
    return [importlib.import_module(f"{package}.{k}") for k in STANDS_ON[key]]


def _in_effect(under: list[str], own: list[str]) -> list[str]:
    """The earlier pieces that actually run: a dense attention backend is replaced by any later one."""
    dense = [p for p in under + own if p.split(".")[1] in DENSE_ATTENTION]
    return [p for p in under if p.split(".")[1] not in DENSE_ATTENTION or p == dense[-1]]


def check_on_ladder(model, module: ModuleType, check: Callable[[], None]) -> list[str]:
    """Run `check()` with `module`'s pieces (stubs included: a stub fails) on top of the written pieces of the
    exercises before it, from the same package. If that fails only because of an earlier exercise (the same check
    passes with the reference underneath), the failure names that exercise. Returns the pieces the passing run used."""
    package = module.__name__.rsplit(".", 1)[0]
    below = earlier_modules(module_key(module), package)
    under: list[str] = []
    try:
        with use_exercises(model, *below, skip_stubs=True) as under, use_exercises(model, module) as own:
            under = _in_effect(under, own)
            check()
            return under + own
    except Exception as ladder_error:  # (a stub's NotImplementedError, a wrong answer, a crash)
        if not under:
            raise
        with use_exercises(model, module) as own:
            check()  # raises: this exercise's own code is what breaks the model
        culprits = sorted({p.split(".")[0] for p in under})
        raise AssertionError(
            f"your {module_key(module)} code runs the real model correctly on the reference, but not on top of your "
            f"earlier pieces ({', '.join(under)}): {type(ladder_error).__name__}: {str(ladder_error)[:300]}. "
            f"Fix those first: {'; '.join(f'minillm grade {c[2:4]}' for c in culprits)}") from ladder_error
