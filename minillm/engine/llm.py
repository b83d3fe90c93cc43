"""`LLM`: the serving engine's front door. Requests in, tokens out, continuous batching in between.

    llm = minillm.LLM("smollm2-135m", dtype="bfloat16", max_num_seqs=16)
    outs = llm.generate(["What is the capital of France?", "Name a prime."], SamplingParams(max_tokens=32), chat=True)
    for ev in llm.stream(["Tell me a story."], SamplingParams(max_tokens=64)): print(ev.text, end="")

Each `step()` asks the Scheduler for work (plain data), has the ModelRunner run it as one packed forward over the
paged KV cache, and hands the sampled tokens back to the scheduler, which retires finished requests at once.
Bad requests are rejected when submitted (ValueError), so they never reach a running batch. Lesson 05.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..block_allocator import blocks_needed
from ..kv_cache import kv_bytes_per_token
from ..paged import PagedKVCache
from ..sampling import SamplingParams, validate_sampling
from .block_manager import BlockManager
from .model_runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence, SequenceStatus

DEFAULT_KV_CACHE_BYTES = 256 << 20


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids, the stop token included
    text: str  # decoded output, stop tokens left out ("" without a tokenizer)
    finish_reason: str | None  # "stop" | "length" | "abort"
    metrics: dict = field(default_factory=dict, repr=False)  # ttft, tpot, itl, e2e, queue_time (s), preemptions


class StreamEvent(NamedTuple):
    request_id: str
    token_id: int
    text: str  # the text this token completes ("" inside a multi-byte character or for a stop token)
    finished: bool


class LLM:
    def __init__(self, model_name: str = "smollm2-135m", dtype: str = "float32", device: str = "cpu",
                 num_blocks: int | None = None, kv_cache_bytes: int | None = None, block_size: int = 16,
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 512, attn_backend: str = "sdpa"):
        from ..loader import load_model

        model, tokenizer = load_model(model_name, dtype=dtype, device=device, attn_backend=attn_backend)
        self._setup(model, tokenizer, num_blocks, kv_cache_bytes, block_size, max_num_seqs, max_num_batched_tokens)

    @classmethod
    def from_model(cls, model, tokenizer=None, num_blocks: int | None = None, kv_cache_bytes: int | None = None,
                   block_size: int = 16, max_num_seqs: int = 16, max_num_batched_tokens: int = 512) -> LLM:
        """Serve an already loaded model (tokenizer None: prompts must be token ids; text comes back empty)."""
        llm = cls.__new__(cls)
        llm._setup(model, tokenizer, num_blocks, kv_cache_bytes, block_size, max_num_seqs, max_num_batched_tokens)
        return llm

    def _setup(self, model, tokenizer, num_blocks, kv_cache_bytes, block_size, max_num_seqs, max_num_batched_tokens):
        cfg = model.config
        if num_blocks is None:  # size the pool by a byte budget, no bigger than max_num_seqs full contexts
            budget = DEFAULT_KV_CACHE_BYTES if kv_cache_bytes is None else kv_cache_bytes
            per_block = kv_bytes_per_token(cfg, model.dtype) * block_size
            num_blocks = min(budget // per_block, max_num_seqs * blocks_needed(cfg.max_seq_len, block_size))
        elif kv_cache_bytes is not None:
            raise ValueError("give num_blocks or kv_cache_bytes, not both")
        if num_blocks < 1:
            raise ValueError(f"the KV budget holds no block of {block_size} tokens: raise kv_cache_bytes/num_blocks")
        self.model, self.tokenizer = model, tokenizer
        self.cache = PagedKVCache(cfg, int(num_blocks), block_size, model.dtype, model.device)
        self.block_manager = BlockManager(self.cache.allocator)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens)
        self.runner = ModelRunner(model, self.cache)
        self.max_model_len = cfg.max_seq_len
        self.step_log: list[dict] = []  # one entry per step: batch occupancy, tokens, preemptions
        self._seqs: dict[str, Sequence] = {}  # in flight
        self._finished: dict[str, RequestOutput] = {}
        self._ids = itertools.count()

    # ------------------------------------------------------------------------------------------------ requests

    def _prompt_ids(self, prompt: str | list[int], chat: bool) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("the prompt is empty: give some text or a non-empty list of token ids")
            if self.tokenizer is None:
                raise ValueError("this LLM has no tokenizer: pass prompts as lists of token ids")
            if chat:
                return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("the prompt is empty: give some text or a non-empty list of token ids")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be ints in [0, {vocab}), got {bad[:5]}")
        return ids

    def _check_request(self, ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        validate_sampling(params.max_tokens, params.temperature, params.top_k, params.top_p)
        if params.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1 for a request to the engine")
        ctx = self.max_model_len
        if len(ids) >= ctx:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context window is {ctx}: shorten it")
        if len(ids) + params.max_tokens > ctx:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context window "
                             f"({ctx}): lower max_tokens to at most {ctx - len(ids)}")
        peak = blocks_needed(len(ids) + params.max_tokens - 1, self.block_manager.block_size)
        if peak > self.block_manager.num_blocks:
            raise ValueError(f"prompt + max_tokens need {peak} KV blocks at their peak but the whole pool has "
                             f"{self.block_manager.num_blocks}: lower max_tokens or build the LLM with more blocks")

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    chat: bool = False, arrival_time: float | None = None) -> str:
        """Queue one request; returns its id. Raises ValueError (and queues nothing) for an invalid request."""
        params = SamplingParams() if params is None else params
        ids = self._prompt_ids(prompt, chat)
        self._check_request(ids, params)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._seqs or request_id in self._finished:
            raise ValueError(f"request id {request_id!r} is already in use")
        stops = set() if params.ignore_eos else set(getattr(self.tokenizer, "stop_ids", ())) | params.stop_ids
        gen = torch.Generator(device=self.model.device).manual_seed(params.seed) if params.seed is not None else None
        seq = Sequence(request_id, ids, params, stop_ids=frozenset(stops), max_model_len=self.max_model_len,
                       arrival_time=time.perf_counter() if arrival_time is None else arrival_time, generator=gen)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Cancel a request in flight (its KV blocks return to the pool). False if it is not in flight."""
        seq = self.scheduler.abort(str(request_id))
        if seq is None:
            return False
        seq.finish_time = time.perf_counter()
        self._retire(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---------------------------------------------------------------------------------------------------- steps

    def step(self) -> list[tuple[Sequence, int]]:
        """One scheduler step + one forward. Returns (sequence, sampled token) for each sequence that got one."""
        schedule = self.scheduler.schedule()
        t0 = time.perf_counter()
        for item in schedule.scheduled:
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = t0
        sampled = self.runner.run(schedule)
        now = time.perf_counter()
        finished = self.scheduler.postprocess(schedule, sampled, now)
        self.step_log.append({
            "t_start": t0, "t_end": now, "num_seqs": len(schedule.scheduled), "num_decodes": schedule.num_decodes,
            "num_prefill_tokens": schedule.num_prefill_tokens, "num_tokens": schedule.num_batched_tokens,
            "num_preempted": len(schedule.preempted), "num_waiting": len(self.scheduler.waiting),
            "occupancy": len(schedule.scheduled) / self.scheduler.max_num_seqs,
            "free_blocks": self.block_manager.num_free(),
        })
        for seq in finished:
            self._retire(seq)
        return [(item.seq, tok) for item, tok in zip(schedule.scheduled, sampled) if tok is not None]

    def _retire(self, seq: Sequence) -> None:
        self._seqs.pop(seq.request_id, None)
        text_ids = [t for t in seq.output_ids if t not in seq.stop_ids]
        text = self.tokenizer.decode(text_ids) if self.tokenizer is not None else ""
        self._finished[seq.request_id] = RequestOutput(seq.request_id, list(seq.prompt_ids), list(seq.output_ids),
                                                       text, seq.finish_reason, seq.metrics())

    def pop_output(self, request_id: str) -> RequestOutput:
        return self._finished.pop(str(request_id))

    # ------------------------------------------------------------------------------------------- conveniences

    def _submit(self, prompts, params, chat: bool) -> list[str]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("pass a list of prompts (strings or lists of token ids), e.g. [prompt]")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        prepared = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):  # validate every request before queueing any
            try:
                ids = self._prompt_ids(prompt, chat)
                self._check_request(ids, p)
            except (ValueError, TypeError) as e:
                raise type(e)(f"request {i}: {e}") from None
            prepared.append((ids, p))
        return [self.add_request(ids, p) for ids, p in prepared]

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 chat: bool = False) -> list[RequestOutput]:
        """Run all prompts to completion with continuous batching; outputs in input order."""
        ids = self._submit(prompts, params, chat)
        pending = set(ids)
        while pending & (self._seqs.keys()):
            self.step()
        return [self.pop_output(r) for r in ids]

    def stream(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
               chat: bool = False) -> Iterator[StreamEvent]:
        """Yield each token as soon as it is sampled, interleaved across requests. Calling `abort(id)` from the loop
        ends that request; the others go on."""
        ids = self._submit(prompts, params, chat)
        decoders = {r: self.tokenizer.stream_decoder() for r in ids} if self.tokenizer is not None else {}
        mine = set(ids)
        try:
            while mine & self._seqs.keys():
                for seq, tok in self.step():
                    if seq.request_id not in mine:
                        continue
                    text = ""
                    if seq.request_id in decoders and tok not in seq.stop_ids:
                        text = decoders[seq.request_id].push(tok)
                    if seq.is_finished and seq.request_id in decoders:
                        text += decoders[seq.request_id].flush()
                    yield StreamEvent(seq.request_id, tok, text, seq.is_finished)
        finally:  # the caller stopped iterating early: don't leave its requests holding blocks
            for r in ids:
                if r in self._seqs:
                    self.abort(r)
                self._finished.pop(r, None)

    def num_free_blocks(self) -> int:
        return self.block_manager.num_free()

    def __repr__(self) -> str:
        return (f"LLM(blocks={self.block_manager.num_blocks}x{self.block_manager.block_size}, "
                f"max_num_seqs={self.scheduler.max_num_seqs}, "
                f"max_num_batched_tokens={self.scheduler.max_num_batched_tokens})")


__all__ = ["LLM", "RequestOutput", "SequenceStatus", "StreamEvent"]
