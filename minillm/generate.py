"""The decode loop: prefill the prompt once, then one token per step until a stop token or the budget.

`cache="none"` is the baseline every later lesson beats: each step re-runs the model over the whole sequence.
`cache="contiguous"` (the default, lesson 01) keeps past keys/values; `cache="paged"` stores them in blocks (lesson 04).
The loop is the same for all three; only where keys and values live changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams, sample_from_logits

CACHE_KINDS = ("none", "contiguous", "paged")


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    ttft_s: float  # prompt in -> first token out (prefill + one sample)
    decode_s: float  # time for the tokens after the first
    stop_reason: str  # "stop_token" | "max_tokens"
    token_times: list[float] = field(default_factory=list, repr=False)  # seconds since start, per token

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else float("nan")


def make_cache(kind: str, model, max_len: int, batch_size: int = 1):
    if kind == "none":
        return None
    if kind == "contiguous":
        from .kv_cache import KVCache

        return KVCache.for_model(model, batch_size, max_len)
    if kind == "paged":
        from .paged import PagedKVCache

        return PagedKVCache.for_model(model, batch_size, max_len)
    raise ValueError(f"unknown cache {kind!r}; choose one of {CACHE_KINDS}")


@torch.inference_mode()
def generate_ids(model, prompt_ids: list[int], params: SamplingParams, stop_ids: set[int] = frozenset(),
                 cache: str = "contiguous") -> Iterator[int]:
    """Yield new token ids one at a time. Stops after a token in `stop_ids | params.stop_ids` (which is yielded)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    ctx = model.config.max_seq_len
    if len(prompt_ids) >= ctx:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the context window is {ctx}: shorten it")
    max_new = min(params.max_tokens, ctx - len(prompt_ids))
    stops = set() if params.ignore_eos else set(stop_ids) | params.stop_ids
    gen = torch.Generator(device=model.device).manual_seed(params.seed) if params.seed is not None else None
    kv = make_cache(cache, model, len(prompt_ids) + max_new)
    seq = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    step_input = seq
    for _ in range(max_new):
        logits = model(step_input, kv_cache=kv, last_only=True)[:, -1]  # (1, vocab)
        token = sample_from_logits(logits, params.temperature, params.top_k, params.top_p, gen)  # (1,)
        tok = int(token)
        yield tok
        if tok in stops:
            return
        if kv is None:  # baseline: feed the whole sequence again next step
            seq = torch.cat([seq, token[:, None]], dim=1)
            step_input = seq
        else:  # cached: only the new token goes through the model
            step_input = token[:, None]


def generate(model, tokenizer, prompt: str | list[int], max_new_tokens: int = 128, temperature: float = 0.0,
             top_k: int | None = None, top_p: float = 1.0, seed: int | None = None, stop_ids: set[int] | None = None,
             cache: str = "contiguous", chat: bool = True, ignore_eos: bool = False,
             on_text: Callable[[str], None] | None = None) -> GenerationResult:
    """Generate from a text prompt (wrapped in the chat template when `chat`) or from token ids.

    `on_text` receives decoded text as it is produced (for streaming). Returns the text, ids and timings.
    """
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("the prompt is empty: give some text to continue or a question to answer")
        ids = tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat else tokenizer.encode(prompt)
    else:
        ids = list(prompt)
    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            stop_ids=stop_ids or set(), ignore_eos=ignore_eos)
    if cache not in CACHE_KINDS:
        raise ValueError(f"unknown cache {cache!r}; choose one of {CACHE_KINDS}")
    stops = set(tokenizer.stop_ids)
    out: list[int] = []
    times: list[float] = []
    stream = tokenizer.stream_decoder() if on_text else None
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for tok in generate_ids(model, ids, params, stops, cache):
        sync()
        times.append(time.perf_counter() - t0)
        out.append(tok)
        if stream is not None and tok not in stops:
            piece = stream.push(tok)
            if piece:
                on_text(piece)
    if stream is not None:
        tail = stream.flush()
        if tail:
            on_text(tail)
    text_ids = [t for t in out if t not in stops]
    stopped = bool(out) and out[-1] in (stops | params.stop_ids) and not ignore_eos
    return GenerationResult(
        text=tokenizer.decode(text_ids),
        token_ids=out,
        prompt_tokens=len(ids),
        ttft_s=times[0] if times else float("nan"),
        decode_s=(times[-1] - times[0]) if len(times) > 1 else 0.0,
        stop_reason="stop_token" if stopped else "max_tokens",
        token_times=times,
    )
