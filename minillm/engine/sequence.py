"""One request's state as it moves through the engine (lesson 05): tokens, status, block table, timestamps.

`Sequence` is plain data: the scheduler moves it between the waiting and running queues, the block manager
fills its `block_table`, the model runner computes tokens from `all_ids[num_cached_tokens:]` (a prefill chunk,
the history recomputed after a preemption, or the last sampled token), postprocess appends each sampled token.
`metrics()` turns its timestamps into TTFT, TPOT, ITL and E2E.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from minillm.request import Request, RequestOutput, finish_reason
from minillm.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV blocks (new, or preempted and waiting to be recomputed)
    RUNNING = "running"  # admitted: holds KV blocks for its tokens
    FINISHED = "finished"  # hit a stop token / max_tokens / the context limit; blocks freed
    ABORTED = "aborted"  # cancelled by the caller; blocks freed


@dataclass(eq=False)  # identity semantics: two requests with the same tokens are still two requests
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int] = frozenset()  # tokenizer's end-of-turn ids | params.stop_ids (empty with ignore_eos)
    max_model_len: int = 8192  # the context window: a sequence never grows past it
    arrival_time: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)  # KV block ids, in token order
    num_cached_tokens: int = 0  # tokens whose keys/values are already in the KV cache
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # wall time at which each output token was sampled
    finish_time: float | None = None
    generator: torch.Generator | None = field(default=None, repr=False)  # per-request RNG for seeded sampling
    logprobs: list[float] = field(default_factory=list, repr=False)  # per output token, when params.logprobs
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list, repr=False)  # params.top_logprobs > 0
    block_hashes: list[bytes] = field(default_factory=list, repr=False)  # names of its full blocks (prefix caching)
    num_named_blocks: int = 0  # leading blocks of block_table that are in the prefix cache
    # sample i > 0 of n (prefix caching on): admitted once sample 0 has computed the shared prompt (BlockManager)
    prefix_source: Sequence | None = field(default=None, repr=False)

    @classmethod
    def from_request(cls, req: Request, max_model_len: int) -> Sequence:
        return cls(req.request_id, list(req.prompt_ids), req.params, stop_ids=req.stop_ids,
                   max_model_len=max_model_len, arrival_time=req.arrival_time, generator=req.generator)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncached_tokens(self) -> int:
        """Tokens the model still has to run before it can sample the next one."""
        return self.num_tokens - self.num_cached_tokens

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def is_finished(self) -> bool:
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.ABORTED)

    def append_token(self, token_id: int, now: float) -> None:
        self.output_ids.append(int(token_id))
        self.token_times.append(now)

    def stop_reason(self) -> str | None:
        """Why this sequence must stop after its last token, or None to go on."""
        return finish_reason(self.output_ids, self.stop_ids, self.params.max_tokens, self.num_tokens,
                             self.max_model_len)

    def to_output(self, tokenizer=None) -> RequestOutput:
        text_ids = [t for t in self.output_ids if t not in self.stop_ids]
        n = len(self.output_ids)  # a verification step may have scored tokens after the stop
        return RequestOutput(self.request_id, list(self.prompt_ids), list(self.output_ids),
                             tokenizer.decode(text_ids) if tokenizer is not None else "", self.finish_reason,
                             self.metrics(), [t - self.arrival_time for t in self.token_times],
                             self.logprobs[:n] if self.params.logprobs else None,
                             self.top_logprobs[:n] if self.params.top_logprobs else None)

    def metrics(self) -> dict[str, float | list[float]]:
        """Latencies in seconds (NaN where undefined, e.g. TPOT of a one-token answer)."""
        nan = float("nan")
        first = self.token_times[0] if self.token_times else None
        n = len(self.token_times)
        return {
            "arrival_time": self.arrival_time,
            "ttft": first - self.arrival_time if first is not None else nan,
            "tpot": (self.token_times[-1] - first) / (n - 1) if n > 1 else nan,
            "itl": [b - a for a, b in zip(self.token_times, self.token_times[1:])],
            "e2e": self.finish_time - self.arrival_time if self.finish_time is not None else nan,
            "queue_time": (self.first_scheduled_time - self.arrival_time
                           if self.first_scheduled_time is not None else nan),
            "num_preemptions": self.num_preemptions,
        }
