"""The front door: `load_model`, `generate` and `chat` with every option the lessons add.

The core loop (minillm/decode_loop.py) knows a model, a cache and a sampler. This file picks what it runs: which
cache (none: lesson 00; contiguous: 01; int8: 07; paged: 04), the compiled step (06) or the speculative loop (10),
and which layers the model file is loaded into (fused: 06; the file's own 4-bit blocks: 07).
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
from collections.abc import Callable, Iterator

import torch
from minillm_kernels import cpu_lowbit

from minillm.cache.block_allocator import blocks_needed
from minillm.cache.paged import PagedSequenceCache
from minillm.compile.fusion import fuse as fuse_model
from minillm.compile.torch_compile import decode_tokens_compiled
from minillm.compress.quant import Int4Linear, Int8Linear, QuantizedEmbedding, cpu_kernels
from minillm.decode_loop import decode_tokens
import minillm.gguf.converted as converted_cache
from minillm.gguf.loader import load_from_file, resolve_device
from minillm.gguf.saved import saved_model_exists
from minillm.gguf.weights import KNOWN_MODELS, gguf_path
import minillm.kv_cache as kv_cache
from minillm.request import Request, RequestOutput, finish_reason, make_request
from minillm.sampling import SamplingParams
from minillm.speculative.decoding import SpeculativeConfig, check_budget, generate_speculative, make_drafter

CACHE_KINDS = ("none", "contiguous", "paged")
WEIGHTS = {
    "dequantized": "every tensor expanded to `dtype` at load (the reference model of every lesson)",
    "q4": "the file's Q4_1 tensors kept as 4-bit Int4Linear layers, bit for bit (lesson 07); on a CPU where minillm's "
          "low-bit kernels load, the Q8_0 tied embedding/LM head too (an Int8Linear per block); the rest in `dtype`",
    "int8": "every block Linear re-quantized from the float weights to int8 per output channel (lesson 07); the tied "
            "embedding/LM head stays in `dtype`",
    "int4": "every block Linear re-quantized from the float weights to int4, groups of 32 (lesson 07): what a pruned "
            "model is quantized with, since the file's own 4-bit bytes cannot be pruned",
}
SPARSITY = {
    None: "dense",
    "2:4": "Wanda 2:4 on every block Linear, calibrated on 512 tokens of held-out text (lesson 08); quantized on top "
           "when weights is 'int8' or 'int4' (prune first: a zero stays exactly zero through int8's symmetric grid)",
}


def check_weights(weights: str, sparsity: str | None) -> None:
    """Refuse an unknown or non-composing weights/sparsity pair before anything loads."""
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights={weights!r}; choose one of {list(WEIGHTS)}")
    if sparsity not in SPARSITY:
        raise ValueError(f"unknown sparsity={sparsity!r}; choose one of {list(SPARSITY)}")
    if sparsity is not None and weights == "q4":
        raise ValueError("weights='q4' keeps the file's own 4-bit bytes, and pruning must change weights before they "
                         "are quantized: use weights='int4' (prune the float weights, then quantize them) with "
                         f"sparsity={sparsity!r}")


def transform_weights(model, weights: str = "dequantized", sparsity: str | None = None,
                      calib_ids: list[int] | None = None):
    """The weight-side techniques, in the one order that composes: prune the float weights (2:4, lesson 08), then
    quantize them (int8/int4, lesson 07). In place; returns the model. calib_ids: Wanda's calibration tokens."""
    from minillm.compress.quantize import quantize
    from minillm.compress.sparsity import prune

    check_weights(weights, sparsity)
    if sparsity == "2:4":
        prune(model, 0.5, "wanda", "2:4", calib_ids=calib_ids)
    if weights in ("int8", "int4"):
        quantize(model, weights, group_size=32, include_head=False)
    return model


def _q8_0_tied(raw, dtype):
    head = Int8Linear.from_q8_0_kernel_layout(raw)  # the file's Q8_0 rows, straight into the kernels' one copy
    return head, QuantizedEmbedding(head, dtype)


def _q8_0_tied_from(layout: torch.Tensor):
    def build(raw, dtype):  # the cached kernel layout of the file's Q8_0 rows (raw: only its shape is read)
        head = Int8Linear.from_kernel_layout(layout, raw.shape[0], raw.shape[1] // 34 * 32)
        return head, QuantizedEmbedding(head, dtype)

    return build


def _q4_1_from_file(name: str, raw) -> Int4Linear:
    import numpy as np

    from minillm.gguf.weights import q4_1_packed

    packed, d, m = (torch.from_numpy(np.ascontiguousarray(a)) for a in q4_1_packed(raw))
    return Int4Linear.from_packed(packed, d, m, group_size=32)


def _q4_1_shape_only(name: str, raw) -> Int4Linear:
    """The layer of a Q4_1 tensor with its kernel layout's shape on the meta device: its bytes come from the
    converted cache once the model has its final structure (_fill_converted)."""
    rows, n, k = cpu_lowbit.rows_per_group(), raw.shape[0], raw.shape[1] // 20 * 32
    return Int4Linear.from_kernel_layout(torch.empty(-(-n // rows), k // 32, 20 * rows, dtype=torch.uint8,
                                                     device="meta"), n, k)


def _kernel_layouts(model) -> dict[str, torch.Tensor]:
    return {name: m._buffers["kernel_weight"] for name, m in model.named_modules()
            if isinstance(m, (Int4Linear, Int8Linear)) and m.kernel_layout_only}


def _fill_converted(model, converted: dict[str, torch.Tensor]) -> str | None:
    """Put the cached layouts in the layers that hold only their shape; None, or what did not match."""
    for name, layout in _kernel_layouts(model).items():
        if not layout.is_meta:
            continue
        cached = converted.get(name)
        if cached is None or cached.shape != layout.shape or cached.dtype != layout.dtype:
            return f"{name}: {None if cached is None else tuple(cached.shape)} cached, {tuple(layout.shape)} needed"
        layer = model.get_submodule(name)
        layer._buffers["kernel_weight"], layer._packed = cached, (cpu_lowbit.rows_per_group(), cached)
    return None


def _return_freed_memory() -> None:
    """Hand the load's freed buffers (the header's ~98,000 strings, the tokenizer's build) back to the OS: glibc
    keeps freed small blocks for reuse, and they would count in the process's RSS for its whole life."""
    import ctypes

    gc.collect(0)  # the load's own objects: the collector was paused (_collector_paused), so all are in generation 0
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to hand back this way
        pass


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic collector off while a model loads: a load makes ~10^5 objects, and every ~10^4 of them
    triggered a pass over torch's ~10^6 (timed by hand: a cached q4 load 0.60 -> 0.29 s, its model skeleton's
    nn.Module constructors 0.24 -> 0.07 s)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def load_model(name: str = "smollm2-135m", dtype: str | torch.dtype = "float32", device: str | None = "cpu",
               attn_backend: str = "sdpa", fuse: bool = False, weights: str = "dequantized",
               sparsity: str | None = None, native: bool | str = False, max_context: int | None = None):
    """(model, tokenizer) of a known or saved model; downloads and verifies the weights on first use.
    fuse=True applies lesson 06's fusions (same logits, fewer ops per step; with weights="q4" the 4-bit rows are
    concatenated as they are); weights: see WEIGHTS ("q4" keeps the file's 4-bit layers packed); sparsity="2:4"
    prunes before any quantization (see SPARSITY and transform_weights). The order is fixed: load, prune, quantize,
    fuse. native=True (low-bit weights on a CPU) runs every layer of a step in one C++ call (lesson 06's last rung,
    minillm.compile.native; fused first), refused with the reason where it cannot run; native="auto" runs it where
    it can and says on stderr why not elsewhere (no compiler, float weights: the eager layers then).
    minillm.compress.quantize.describe_arithmetic(model) says what the matmuls compute in. model.load_seconds: this
    call's wall time (file, kernels, fusion, the native step). max_context: the longest context (prompt + new
    tokens) this model will serve, as llama.cpp's n_ctx: the RoPE tables stop there and a longer one is refused
    (the edge profile's 512; None, or more than the model's window: that window, whose tables are 4 MiB for 8,192
    positions)."""
    if max_context is not None and (not isinstance(max_context, int) or isinstance(max_context, bool)
                                    or max_context < 1):
        raise ValueError(f"max_context must be a positive number of tokens (or None: the model's window), got "
                         f"{max_context!r}")
    with _collector_paused():
        return _load_model(name, dtype, device, attn_backend, fuse, weights, sparsity, native, max_context)


def _load_model(name, dtype, device, attn_backend, fuse, weights, sparsity, native, max_context=None):
    t0 = time.perf_counter()
    check_weights(weights, sparsity)
    if weights == "q4" and saved_model_exists(name):
        raise ValueError(f"{name!r} is a saved float model with no file of 4-bit blocks to keep: use weights='int4' "
                         f"(its float weights quantized at load) or 'int8'")
    q4_1_layer = _q4_1_from_file if weights == "q4" else None
    # the Q8_0 head stays packed only where our kernel reads it: torch has no per-block int8 matmul (CPU or GPU)
    on_cpu = resolve_device(device).type == "cpu"
    q8_0_tied = _q8_0_tied if weights == "q4" and on_cpu and cpu_kernels() is not None else None
    # the kernels' layouts, converted once and mapped from beside the download afterwards (minillm.gguf.converted)
    cache_key = converted = None
    if q8_0_tied is not None and name in KNOWN_MODELS and converted_cache.enabled():
        cache_key = (gguf_path(name), KNOWN_MODELS[name].sha256, cpu_lowbit.layout_id(), bool(fuse or native))
        converted = converted_cache.read_converted(*cache_key)
    if converted is not None and "lm_head" in converted:
        q4_1_layer = _q4_1_shape_only
        q8_0_tied = _q8_0_tied_from(converted["lm_head"])
    model, tokenizer = load_from_file(name, dtype, device, attn_backend, q4_1_layer=q4_1_layer, q8_0_tied=q8_0_tied)
    if max_context is not None:
        model.limit_context(max_context)
    if weights in ("int8", "int4") or sparsity:
        from minillm.compress.quality import calibration_ids

        transform_weights(model, weights, sparsity, calibration_ids(tokenizer, 512) if sparsity else None)
    if fuse or native:  # the native step runs fused layers: fused here, before the 4-bit layers keep one layout
        fuse_model(model)
    if weights == "q4" and on_cpu:  # one copy of each 4-bit layer and of the Q8_0 head: the kernels' layout
        for layer in model.modules():  # (a no-op without the kernels)
            if isinstance(layer, (Int4Linear, Int8Linear)):
                layer.keep_kernel_layout_only()
    if q4_1_layer is _q4_1_shape_only and (problem := _fill_converted(model, converted)) is not None:
        print(f"minillm: the converted weights do not fit this model ({problem}); converting from the file",
              file=sys.stderr)
        converted_cache.delete_converted(*cache_key)
        return _load_model(name, dtype, device, attn_backend, fuse, weights, sparsity, native, max_context)
    if cache_key is not None and converted is None:
        converted_cache.write_converted(*cache_key, _kernel_layouts(model))
    if on_cpu:
        _return_freed_memory()
    if native:
        from minillm.compile.native import enable_native, why_not_native

        if native not in (True, "auto"):
            raise ValueError(f"native must be False, True or 'auto', got {native!r}")
        why = why_not_native(model)
        if why is None or native is True:
            enable_native(model)  # raises with `why` when it cannot run
        else:
            print(f"minillm: the native step is off ({why}); the eager layers run", file=sys.stderr)
    model.load_seconds = time.perf_counter() - t0
    return model, tokenizer


def make_cache(kind: str, model, max_len: int, batch_size: int = 1, kv_dtype: torch.dtype | None = None):
    """The cache a decode loop writes: None (recompute), contiguous (KVCache; Int8KVCache when kv_dtype=torch.int8,
    lesson 07) or paged (blocks on demand, lesson 04)."""
    if kind == "none":
        return None
    if kind == "contiguous":
        # through the module, at call time: the course swaps a learner's KVCache in there (course/seams.py)
        cls = kv_cache.Int8KVCache if kv_dtype == torch.int8 else kv_cache.KVCache
        return cls.for_model(model, batch_size, max_len, kv_dtype=kv_dtype)
    if kind == "paged":
        return PagedSequenceCache.for_model(model, batch_size, max_len, kv_dtype=kv_dtype)
    raise ValueError(f"unknown cache {kind!r}; choose one of {CACHE_KINDS}")


def _kv_dtype(kv_cache_dtype: str | None, cache: str, compile: bool) -> torch.dtype | None:
    """generate()'s kv_cache_dtype (the engine's names: None or "int8") as the cache's storage dtype."""
    if kv_cache_dtype not in (None, "int8"):
        raise ValueError(f"kv_cache_dtype must be None (the model's dtype) or 'int8', got {kv_cache_dtype!r}")
    if kv_cache_dtype is None:
        return None
    if cache == "none":
        raise ValueError("kv_cache_dtype='int8' quantizes a KV cache, and cache='none' keeps none: use 'contiguous' "
                         "or 'paged'")
    if compile:
        raise ValueError("compile=True decodes through a float StaticKVCache; kv_cache_dtype='int8' has no compiled "
                         "path: choose one")
    return torch.int8


def generate_request(model, req: Request, cache: str = "contiguous", compile: bool = False,
                     speculative: SpeculativeConfig | None = None, spec_stats=None,
                     kv_cache_dtype: str | None = None) -> Iterator[int]:
    """Yield the new token ids of one validated request through the loop the options choose: compile=True runs
    decode steps through torch.compile (lesson 06); speculative=SpeculativeConfig(...) drafts and verifies several
    tokens per target forward (lesson 10), counting drafted/accepted tokens into spec_stats (a SpecStats) if given;
    kv_cache_dtype="int8" stores the KV cache in int8 (lesson 07), as LLM(kv_cache_dtype="int8") does."""
    if cache not in CACHE_KINDS:
        raise ValueError(f"unknown cache {cache!r}; choose one of {CACHE_KINDS}")
    kv_dtype = _kv_dtype(kv_cache_dtype, cache, compile)
    p = req.params
    if p.has_penalties or p.min_tokens or p.top_logprobs or p.n != 1:  # never silently ignored
        raise ValueError("penalties, min_tokens, top_logprobs and n > 1 are honoured by the engine (minillm.LLM), not "
                         "by this single-sequence loop")
    n_total = len(req.prompt_ids) + req.params.max_tokens
    if speculative is not None:
        if compile:
            raise ValueError("compile=True and speculative decoding do not combine here: choose one")
        if not isinstance(speculative, SpeculativeConfig):
            raise TypeError(f"speculative must be a SpeculativeConfig, got {type(speculative).__name__}")
        # refused here too (generate_speculative checks both), before a draft model is loaded for nothing
        if cache == "none":
            raise ValueError("speculative decoding verifies drafts over a KV cache: use cache='contiguous' or 'paged'")
        k = speculative.k
        check_budget(k, len(req.prompt_ids), model.config.max_seq_len)
        kv = make_cache(cache, model, min(n_total + k, model.config.max_seq_len), kv_dtype=kv_dtype)
        drafter = make_drafter(speculative, model, num_blocks=blocks_needed(n_total + k, 16))
        try:
            yield from generate_speculative(model, req, drafter, k, kv, spec_stats)
        finally:
            drafter.release(req.request_id)
    elif compile:
        if cache != "contiguous":
            raise ValueError(f"compile=True decodes with a static contiguous cache; cache={cache!r} cannot be compiled")
        yield from decode_tokens_compiled(model, req)
    else:
        yield from decode_tokens(model, req, make_cache(cache, model, n_total, kv_dtype=kv_dtype))


def generate_ids(model, prompt_ids: list[int], params: SamplingParams, stop_ids: set[int] = frozenset(),
                 cache: str = "contiguous") -> Iterator[int]:
    """Yield new token ids one at a time. Stops after a token in `stop_ids | params.stop_ids` (which is yielded)."""
    req = make_request(list(prompt_ids), params, None, model.config, model.device, clip_to_context=True,
                       eos_ids=frozenset(stop_ids))
    return generate_request(model, req, cache)


def generate(model, tokenizer, prompt: str | list[int], max_new_tokens: int = 128, temperature: float = 0.0,
             top_k: int | None = None, top_p: float = 1.0, seed: int | None = None, stop_ids: set[int] | None = None,
             cache: str = "contiguous", chat: bool = False, ignore_eos: bool = False,
             on_text: Callable[[str], None] | None = None, compile: bool = False,
             speculative: SpeculativeConfig | None = None, spec_stats=None,
             kv_cache_dtype: str | None = None) -> RequestOutput:
    """Continue a raw text prompt or a list of token ids (vLLM's convention; `chat()` answers messages instead, and
    chat=True wraps a text prompt as one user message). `on_text` receives decoded text as it is produced
    (streaming); compile, speculative and kv_cache_dtype as in generate_request. Returns a RequestOutput: text,
    ids, finish_reason and per-token times."""
    if cache not in CACHE_KINDS:
        raise ValueError(f"unknown cache {cache!r}; choose one of {CACHE_KINDS}")
    _kv_dtype(kv_cache_dtype, cache, compile)  # refused before any work
    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            stop_ids=stop_ids or set(), ignore_eos=ignore_eos)
    req = make_request(prompt, params, tokenizer, model.config, model.device, chat=chat, clip_to_context=True)
    out: list[int] = []
    times: list[float] = []
    stream = tokenizer.stream_decoder() if on_text else None
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for tok in generate_request(model, req, cache, compile, speculative, spec_stats, kv_cache_dtype):
        sync()
        times.append(time.perf_counter() - t0)
        out.append(tok)
        if stream is not None and tok not in req.stop_ids:
            piece = stream.push(tok)
            if piece:
                on_text(piece)
    if stream is not None:
        tail = stream.flush()
        if tail:
            on_text(tail)
    reason = finish_reason(out, req.stop_ids, req.params.max_tokens, len(req.prompt_ids) + len(out),
                           model.config.max_seq_len) or "length"
    text = tokenizer.decode([t for t in out if t not in req.stop_ids]) if tokenizer is not None else ""
    return RequestOutput(req.request_id, req.prompt_ids, out, text, reason, token_times=times)


def chat(model, tokenizer, messages: str | list[dict], **kwargs) -> RequestOutput:
    """Answer a conversation: messages [{"role": "user", "content": ...}, ...] (a str is one user message) go through
    the model's chat template, their contents encoded as plain text. Takes generate()'s keyword arguments."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    return generate(model, tokenizer, tokenizer.encode_chat(messages), **kwargs)
