"""The decode loop: prefill the prompt once, then one token per step until a stop token or the budget.

`cache="none"` is the baseline every later lesson beats: each step re-runs the model over the whole sequence.
`cache="contiguous"` (the default, lesson 01) keeps past keys/values; `cache="paged"` stores them in blocks (lesson 04).
The loop is the same for all three; only where keys and values live changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch

from minillm.request import Request, RequestOutput, finish_reason, make_request
from minillm.sampling import SamplingParams, sample_from_logits

CACHE_KINDS = ("none", "contiguous", "paged")
GenerationResult = RequestOutput  # the name generate() returned before the request layer was shared


def make_cache(kind: str, model, max_len: int, batch_size: int = 1, kv_dtype: torch.dtype | None = None):
    """kv_dtype=torch.int8 stores keys/values in int8 with a scale per token and head (lesson 07)."""
    if kind == "none":
        return None
    if kind == "contiguous":
        from minillm.kv_cache import KVCache

        return KVCache.for_model(model, batch_size, max_len, kv_dtype=kv_dtype)
    if kind == "paged":
        from minillm.cache.paged import PagedSequenceCache

        return PagedSequenceCache.for_model(model, batch_size, max_len, kv_dtype=kv_dtype)
    raise ValueError(f"unknown cache {kind!r}; choose one of {CACHE_KINDS}")


@torch.inference_mode()
def generate_request(model, req: Request, cache: str = "contiguous", compile: bool = False,
                     speculative=None, spec_stats=None) -> Iterator[int]:
    """Yield the new token ids of one validated request, one at a time; the stop token that ends it is yielded.

    compile=True prefills eagerly into a StaticKVCache and runs every decode step through the compiled forward
    (lesson 06); the first call compiles (seconds), later calls with the same cache length reuse it.
    speculative=SpeculativeConfig(...) drafts and verifies several tokens per target forward (lesson 10); the
    counts of drafted and accepted tokens go into spec_stats (a SpecStats) if given."""
    params, ids = req.params, req.prompt_ids
    if speculative is not None:
        yield from _generate_speculative(model, req, cache, compile, speculative, spec_stats)
        return
    if compile:
        from minillm.compile.torch_compile import StaticKVCache, compiled_decode, static_length

        if cache != "contiguous":
            raise ValueError(f"compile=True decodes with a static contiguous cache; cache={cache!r} cannot be compiled")
        kv = StaticKVCache.for_model(model, 1, min(static_length(len(ids) + params.max_tokens),
                                                   model.config.max_seq_len))
        step = compiled_decode(model)
    else:
        kv = make_cache(cache, model, len(ids) + params.max_tokens)
    seq = torch.tensor([ids], dtype=torch.long, device=model.device)
    step_input = seq
    for i in range(params.max_tokens):
        if compile and i > 0:  # decode: fixed shapes, position as a tensor, the host counts
            positions = torch.tensor([kv.seq_len], device=model.device)
            logits = step(step_input, positions=positions, kv_cache=kv, last_only=True)[:, -1]
            kv.seq_len += 1
        else:
            logits = model(step_input, kv_cache=kv, last_only=True)[:, -1]  # (1, vocab)
        token = sample_from_logits(logits, params.temperature, params.top_k, params.top_p, req.generator)  # (1,)
        tok = int(token)
        yield tok
        if tok in req.stop_ids:
            return
        if kv is None:  # baseline: feed the whole sequence again next step
            seq = torch.cat([seq, token[:, None]], dim=1)
            step_input = seq
        else:  # cached: only the new token goes through the model
            step_input = token[:, None]


def _generate_speculative(model, req: Request, cache: str, compile: bool, config, stats) -> Iterator[int]:
    from minillm.cache.block_allocator import blocks_needed
    from minillm.speculative.decoding import SpeculativeConfig, check_budget, generate_speculative, make_drafter

    if compile:
        raise ValueError("compile=True and speculative decoding do not combine here: choose one")
    if not isinstance(config, SpeculativeConfig):
        raise TypeError(f"speculative must be a SpeculativeConfig, got {type(config).__name__}")
    check_budget(config.k, len(req.prompt_ids), model.config.max_seq_len)
    drafter = make_drafter(config, model, num_blocks=blocks_needed(len(req.prompt_ids) + req.params.max_tokens
                                                                   + config.k, 16))
    try:
        yield from generate_speculative(model, req, drafter, config.k, cache, stats)
    finally:
        drafter.release(req.request_id)


def generate_ids(model, prompt_ids: list[int], params: SamplingParams, stop_ids: set[int] = frozenset(),
                 cache: str = "contiguous") -> Iterator[int]:
    """Yield new token ids one at a time. Stops after a token in `stop_ids | params.stop_ids` (which is yielded)."""
    req = make_request(list(prompt_ids), params, None, model.config, model.device, clip_to_context=True,
                       eos_ids=frozenset(stop_ids))
    return generate_request(model, req, cache)  # an unknown cache kind is refused by make_cache


def generate(model, tokenizer, prompt: str | list[int], max_new_tokens: int = 128, temperature: float = 0.0,
             top_k: int | None = None, top_p: float = 1.0, seed: int | None = None, stop_ids: set[int] | None = None,
             cache: str = "contiguous", chat: bool = False, ignore_eos: bool = False,
             on_text: Callable[[str], None] | None = None, compile: bool = False, speculative=None,
             spec_stats=None) -> RequestOutput:
    """Continue a raw text prompt or a list of token ids (vLLM's convention; `chat()` answers messages instead, and
    chat=True wraps a text prompt as one user message). `on_text` receives decoded text as it is produced
    (streaming). compile=True runs decode steps through torch.compile (lesson 06); speculative=SpeculativeConfig(...)
    drafts and verifies several tokens per forward, with the same output distribution (lesson 10). Returns a RequestOutput: text,
    ids, finish_reason and per-token times.
    """
    if cache not in CACHE_KINDS:
        raise ValueError(f"unknown cache {cache!r}; choose one of {CACHE_KINDS}")
    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            stop_ids=stop_ids or set(), ignore_eos=ignore_eos)
    req = make_request(prompt, params, tokenizer, model.config, model.device, chat=chat, clip_to_context=True)
    out: list[int] = []
    times: list[float] = []
    stream = tokenizer.stream_decoder() if on_text else None
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for tok in generate_request(model, req, cache, compile, speculative, spec_stats):
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
