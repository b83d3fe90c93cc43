"""One request layer for every front end: prompt -> a validated `Request` (token ids, stop set, seeded
generator), and the one output type they all return, `RequestOutput`.

`minillm.generate` (lesson 01), the continuous-batching `minillm.LLM` (lesson 05) and the static-batching
baseline take and answer requests the same way, so speculative decoding or a server changes nothing here.
Conventions are vLLM's: a prompt is raw text or a list of token ids (continued as is); `chat` wraps text as
one user message in the model's chat template (`prompt_to_ids`, `make_request`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from minillm.sampling import SamplingParams

FINISH_REASONS = ("stop", "length", "abort", "error")  # error: a worker died (lessons 11, 13); metrics say why


@dataclass
class Request:
    """A validated request: everything the engine needs, nothing it has to check again."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]  # the tokenizer's end-of-turn ids | params.stop_ids (empty with ignore_eos)
    generator: torch.Generator | None = field(default=None, repr=False)  # seeded per request, or None
    arrival_time: float = 0.0


def prompt_to_ids(prompt, tokenizer, vocab_size: int, chat: bool = False) -> list[int]:
    """Text (through the tokenizer, in the chat template when `chat`) or a sequence of token ids -> ids, checked."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("the prompt is empty: give some text or a non-empty list of token ids")
        if tokenizer is None:
            raise ValueError("no tokenizer: pass the prompt as a list of token ids")
        return tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat else tokenizer.encode(prompt)
    if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, (list, tuple)):
        raise TypeError(f"a prompt is a str or a list of token ids, got {type(prompt).__name__}"
                        + (": decode bytes to str first" if isinstance(prompt, (bytes, bytearray)) else ""))
    ids = list(prompt)
    if not ids:
        raise ValueError("the prompt is empty: give some text or a non-empty list of token ids")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be ints in [0, {vocab_size}), got {bad[:5]}")
    return ids


def params_per_prompt(prompts, params) -> list[SamplingParams]:
    """The SamplingParams of each prompt of a batch: one for all (or None: the defaults), or one each. A bare prompt
    (a str, or one list of ids) is a TypeError: batch front ends take a list of prompts."""
    if isinstance(prompts, (str, bytes)) or (prompts and isinstance(prompts[0], int)):
        raise TypeError("pass a list of prompts (strings or lists of token ids), e.g. [prompt]")
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
    return list(params)


def make_request(prompt, params: SamplingParams | None, tokenizer, config, device: torch.device | str = "cpu",
                 request_id: str = "0", chat: bool = False, clip_to_context: bool = False,
                 arrival_time: float | None = None, eos_ids: frozenset[int] | None = None) -> Request:
    """Validate and prepare one request. `clip_to_context` lowers max_tokens to what the context window leaves
    (generate()'s convenience); otherwise a request that cannot fit is refused with the number to use. The stop set
    is `eos_ids` (default: the tokenizer's end-of-turn ids) plus params.stop_ids, empty with ignore_eos."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    params.validate()  # again: its fields may have changed since it was made
    ids = prompt_to_ids(prompt, tokenizer, config.vocab_size, chat)
    ctx = config.max_seq_len
    if len(ids) >= ctx:
        raise ValueError(f"the prompt has {len(ids)} tokens; the context window is {ctx}: shorten it")
    if len(ids) + params.max_tokens > ctx:
        if not clip_to_context:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                             f"window ({ctx}): lower max_tokens to at most {ctx - len(ids)}")
        room = ctx - len(ids)
        params = SamplingParams(**{**params.__dict__, "max_tokens": room, "min_tokens": min(params.min_tokens, room)})
    eos_ids = frozenset(getattr(tokenizer, "stop_ids", ())) if eos_ids is None else frozenset(eos_ids)
    stops = frozenset() if params.ignore_eos else eos_ids | params.stop_ids
    gen = torch.Generator(device=device).manual_seed(params.seed) if params.seed is not None else None
    return Request(str(request_id), ids, params, stops, gen,
                   time.perf_counter() if arrival_time is None else arrival_time)


@dataclass
class RequestOutput:
    """What every front end returns for one request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids, the stop token included
    text: str  # decoded output, stop tokens left out ("" without a tokenizer)
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    metrics: dict = field(default_factory=dict, repr=False)  # ttft, tpot, itl, e2e, queue_time (s), preemptions
    token_times: list[float] = field(default_factory=list, repr=False)  # seconds since arrival, per token
    logprobs: list[float] | None = field(default=None, repr=False)  # per token, when params.logprobs
    # per token, its params.top_logprobs most likely alternatives [(id, logprob)], most likely first (raw logits)
    top_logprobs: list[list[tuple[int, float]]] | None = field(default=None, repr=False)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def ttft_s(self) -> float:
        """Prompt in -> first token out (queueing + prefill + one sample)."""
        return self.token_times[0] if self.token_times else float("nan")

    @property
    def decode_s(self) -> float:
        """Time for the tokens after the first."""
        return self.token_times[-1] - self.token_times[0] if len(self.token_times) > 1 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.token_times) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else float("nan")


def finish_reason(output_ids: list[int], stop_ids: frozenset[int], max_tokens: int, num_tokens: int,
                  max_model_len: int) -> str | None:
    """Why a sequence must stop after its last token, or None to go on."""
    if output_ids and output_ids[-1] in stop_ids:
        return "stop"
    if len(output_ids) >= max_tokens or num_tokens >= max_model_len:
        return "length"
    return None
