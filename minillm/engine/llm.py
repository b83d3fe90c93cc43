"""`LLM`, the serving engine (lesson 05): requests in, tokens out, continuous batching in between.

    llm = minillm.LLM("smollm2-135m", dtype="bfloat16", max_num_seqs=16)  # or LLM.from_model(model, tok)
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=32))  # also chat, stream

Each step(): schedule (plain data) -> propose drafts (lesson 10) -> run one packed forward -> postprocess
(append, retire, free blocks; hand off prefilled KV, lesson 13) -> emit each token into its request's queue.
The knobs: EngineConfig (engine/config.py); the disaggregation methods: handoff.py. A request's sampling settings
(penalties, min_tokens, logprobs: SamplingParams) travel with its Sequence; `add_samples` queues n samples of one
prompt (SamplingParams.n), which share its KV blocks under prefix caching.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

from minillm.cache.block_allocator import BlockAllocator, blocks_needed
from minillm.cache.kv_transfer import KVHandoff
from minillm.cache.paged import PagedKVCache
from minillm.cache.prefix_cache import PrefixCachingAllocator
from minillm.engine.block_manager import BlockManager
from minillm.engine.config import EngineConfig
from minillm.engine.handoff import HandoffMixin
from minillm.engine.model_runner import ModelRunner
from minillm.engine.scheduler import Schedule, Scheduler
from minillm.engine.sequence import Sequence, SequenceStatus
from minillm.request import Request, RequestOutput, make_request, params_per_prompt
from minillm.sampling import SamplingParams
from minillm.speculative.decoding import SpecStats, SpeculativeConfig, make_drafter


class StreamEvent(NamedTuple):
    request_id: str
    token_id: int | None  # None only in the event that reports an abort
    text: str  # the text this token completes ("" inside a multi-byte character or for a stop token)
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last event
    logprob: float | None = None  # the token's raw log-probability, when params.logprobs
    top_logprobs: list[tuple[int, float]] | None = None  # [(id, logprob)] most likely first, params.top_logprobs


def sample_ids(request_id: str, n: int) -> list[str]:
    """The ids of the n samples of one request (LLM.add_samples): request_id itself when n == 1, else
    f"{request_id}-{i}"."""
    return [str(request_id)] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


class LLM(HandoffMixin):
    def __init__(self, model_name: str = "smollm2-135m", dtype: str = "float32", device: str = "cpu",
                 num_blocks: int | None = None, kv_cache_bytes: int | None = None, block_size: int = 16,
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 512, attn_backend: str = "sdpa",
                 fuse: bool = False, kv_cache_dtype: str | None = None, weights: str = "dequantized",
                 speculative: SpeculativeConfig | None = None, enable_prefix_caching: bool = False,
                 sparsity: str | None = None):
        from minillm.api import load_model

        model, tokenizer = load_model(model_name, dtype=dtype, device=device, attn_backend=attn_backend, fuse=fuse,
                                      weights=weights, sparsity=sparsity)
        self._setup(model, tokenizer, EngineConfig(
            num_blocks=num_blocks, kv_cache_bytes=kv_cache_bytes, block_size=block_size,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, speculative=speculative,
            kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=enable_prefix_caching))

    @classmethod
    def from_model(cls, model, tokenizer=None, num_blocks: int | None = None, kv_cache_bytes: int | None = None,
                   block_size: int = 16, max_num_seqs: int = 16, max_num_batched_tokens: int = 512,
                   kv_cache_dtype: str | None = None, speculative: SpeculativeConfig | None = None,
                   enable_prefix_caching: bool = False) -> LLM:
        """Serve an already loaded model (tokenizer None: prompts must be token ids; text comes back empty).
        The keywords are EngineConfig's (kv_cache_dtype="int8": lesson 07, speculative: lesson 10,
        enable_prefix_caching: lesson 12)."""
        llm = cls.__new__(cls)
        llm._setup(model, tokenizer, EngineConfig(
            num_blocks=num_blocks, kv_cache_bytes=kv_cache_bytes, block_size=block_size,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, speculative=speculative,
            kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=enable_prefix_caching))
        return llm

    def _setup(self, model, tokenizer, config: EngineConfig) -> None:
        self.model, self.tokenizer, self.config = model, tokenizer, config
        num_blocks, block_size = config.pool_blocks(model), config.block_size
        # one allocator: the block manager decides who owns which block, the cache holds what is in each one
        allocator = (PrefixCachingAllocator if config.enable_prefix_caching else BlockAllocator)(num_blocks,
                                                                                                  block_size)
        self.cache = PagedKVCache(model.config, num_blocks, block_size, model.dtype, model.device,
                                  kv_dtype=config.kv_dtype, n_layers=len(model.layers), allocator=allocator)
        self.block_manager = BlockManager(allocator, prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(model, self.cache, config.max_num_batched_tokens)
        spec = config.speculative  # the draft model's own paged cache holds as many tokens as the target's
        self.drafter = make_drafter(spec, model, num_blocks, block_size) if spec is not None else None
        self.spec_stats = SpecStats()
        self.max_model_len = model.config.max_seq_len
        self.step_log: list[dict] = []  # one entry per step: batch occupancy, tokens, preemptions
        self._seqs: dict[str, Sequence] = {}  # in flight
        self._finished: dict[str, RequestOutput] = {}
        self._ids = itertools.count()
        self._lock = threading.RLock()  # one step (and one change of the queues) at a time, whoever calls it
        self._sinks: dict[str, queue.SimpleQueue] = {}  # request id -> where its StreamEvents go
        self._decoders: dict = {}  # request id -> incremental detokenizer, for requests with a sink
        self._prefill_only: dict[str, SamplingParams] = {}  # add_prefill's requests -> the caller's params
        self._handoffs: list[KVHandoff] = []  # packed when their first token was sampled, until pop_handoffs

    # ------------------------------------------------------------------------------------------------ requests

    def _prepare(self, prompt: str | list[int], params: SamplingParams | None, chat: bool,
                 request_id: str | None, arrival_time: float | None) -> Request:
        req = make_request(prompt, params, self.tokenizer, self.model.config, self.model.device,
                           request_id=str(next(self._ids)) if request_id is None else str(request_id), chat=chat,
                           arrival_time=arrival_time)
        if req.params.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1 for a request to the engine")
        peak = blocks_needed(len(req.prompt_ids) + req.params.max_tokens - 1, self.block_manager.block_size)
        if peak > self.block_manager.num_blocks:
            raise ValueError(f"prompt + max_tokens need {peak} KV blocks at their peak but the whole pool has "
                             f"{self.block_manager.num_blocks}: lower max_tokens or build the LLM with more blocks")
        if req.request_id in self._seqs or req.request_id in self._finished:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.params.n != 1:
            raise ValueError(f"params.n is {req.params.n}: one request is one sequence; add_samples (or generate, "
                             f"chat, stream) queues n samples of a prompt")
        return req

    def _prepare_samples(self, prompt: str | list[int], params: SamplingParams | None, chat: bool,
                         request_id: str | None, arrival_time: float | None) -> list[Request]:
        """The params.n samples of one prompt, validated: sample i gets params.for_sample(i) (seed + i) and, when
        n > 1, the id f"{request_id}-{i}"; the prompt is tokenized once."""
        n = params.n if isinstance(params, SamplingParams) else 1
        if n == 1:
            return [self._prepare(prompt, params, chat, request_id, arrival_time)]
        ids = sample_ids(str(next(self._ids)) if request_id is None else str(request_id), n)
        first = self._prepare(prompt, params.for_sample(0), chat, ids[0], arrival_time)
        return [first] + [self._prepare(first.prompt_ids, params.for_sample(i), False, ids[i], first.arrival_time)
                          for i in range(1, n)]

    def _enqueue(self, req: Request, sink: queue.SimpleQueue | None, prefix_source: Sequence | None = None) -> str:
        seq = Sequence.from_request(req, self.max_model_len)
        if self.block_manager.prefix_caching:  # admitted once prefix_source has computed the shared prompt
            seq.prefix_source = prefix_source
        self._seqs[req.request_id] = seq
        if sink is not None:
            self._sinks[req.request_id] = sink
            if self.tokenizer is not None:
                self._decoders[req.request_id] = self.tokenizer.stream_decoder()
        self.scheduler.add(seq)
        return req.request_id

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    chat: bool = False, arrival_time: float | None = None, sink: queue.SimpleQueue | None = None
                    ) -> str:
        """Queue one request; returns its id. Raises ValueError (and queues nothing) for an invalid request.
        `sink`, if given, receives a StreamEvent for each of its tokens (and its end)."""
        with self._lock:
            return self._enqueue(self._prepare(prompt, params, chat, request_id, arrival_time), sink)

    def add_samples(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    chat: bool = False, arrival_time: float | None = None, sink: queue.SimpleQueue | None = None
                    ) -> list[str]:
        """Queue params.n samples of one prompt (OpenAI's and vLLM's `n`); returns their ids, f"{request_id}-{i}"
        (just request_id when n == 1). Sample i is seeded with seed + i. With prefix caching the prompt is computed
        once: samples 1..n-1 wait for sample 0's prefill and share its KV blocks."""
        with self._lock:
            return self._enqueue_samples(self._prepare_samples(prompt, params, chat, request_id, arrival_time), sink)

    def _enqueue_samples(self, reqs: list[Request], sink: queue.SimpleQueue | None) -> list[str]:
        first = self._enqueue(reqs[0], sink)
        return [first] + [self._enqueue(r, sink, prefix_source=self._seqs[first]) for r in reqs[1:]]

    def abort(self, request_id: str) -> bool:
        """Cancel a request in flight (its KV blocks return to the pool). False if it is not in flight."""
        with self._lock:
            seq = self.scheduler.abort(str(request_id))
            if seq is None:
                return False
            seq.finish_time = time.perf_counter()
            self._emit(seq, None)
            self._retire(seq)
            return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---------------------------------------------------------------------------------------------------- steps

    def step(self) -> list[tuple[Sequence, int]]:
        """One engine step: schedule -> propose drafts -> run one packed forward -> postprocess -> emit.
        Returns (sequence, token) for each token emitted."""
        with self._lock:
            schedule, t0 = self._schedule()
            draft_probs = self._propose(schedule)
            sampled = self.runner.run(schedule, draft_probs)
            if getattr(self.drafter, "wants_features", False):  # lesson 10's learned drafter: which row is whose
                self.drafter.observe([(c.seq.request_id, c.start + c.num_new_tokens + len(c.draft_ids) - n, n)
                                      for c in schedule.scheduled
                                      for n in [1 + len(c.draft_ids) if c.samples else 0]])
            new_tokens, finished = self._postprocess(schedule, sampled, t0)
            return self._emit_step(new_tokens, finished)

    def _schedule(self) -> tuple[Schedule, float]:
        """The scheduler's plan for this step, and when it was made. With speculation (lesson 10) each
        decode also gets KV slots for k draft tokens, while the batch is small enough for verifying to be
        nearly free."""
        spec = self.config.speculative
        k = spec.k if spec is not None and len(self.scheduler.running) <= spec.max_batch else 0
        schedule = self.scheduler.schedule(k)
        t0 = time.perf_counter()
        for item in schedule.scheduled:
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = t0
        return schedule, t0

    def _propose(self, schedule: Schedule) -> list:
        """Drafts for every decode that got lookahead slots (one batched call); their distributions, per item."""
        items = [i for i, item in enumerate(schedule.scheduled) if item.num_lookahead]
        probs: list = [None] * len(schedule.scheduled)
        if not items:
            return probs
        seqs = [schedule.scheduled[i].seq for i in items]
        proposals = self.drafter.propose([(s.request_id, s.all_ids, schedule.scheduled[i].num_lookahead)
                                          for i, s in zip(items, seqs)],
                                         [s.params for s in seqs], [s.generator for s in seqs])
        for i, (draft, q) in zip(items, proposals):
            schedule.scheduled[i].draft_ids = draft
            probs[i] = q
        return probs

    def _postprocess(self, schedule: Schedule, sampled: list[list[int]], t0: float
                     ) -> tuple[list[tuple[Sequence, list[int]]], list[Sequence]]:
        """Hand the sampled tokens to the scheduler, which appends them and retires finished sequences (their
        blocks are freed at once: a prefill-only request's KV is packed into its handoff first, lesson 13).
        Returns each scheduled sequence's new tokens (a stop drops those after it) and the finished ones."""
        now = time.perf_counter()
        if self._prefill_only:
            self._pack_handoffs(schedule, sampled, now)
        n_before = [item.seq.num_output_tokens for item in schedule.scheduled]
        finished = self.scheduler.postprocess(schedule, sampled, now)
        for item, tokens in zip(schedule.scheduled, sampled):
            if item.num_lookahead:
                self.spec_stats.record(len(item.draft_ids), len(tokens) - 1, len(tokens))
        self.step_log.append({
            "t_start": t0, "t_end": now, "num_seqs": len(schedule.scheduled),
            "num_decodes": schedule.num_decodes, "num_prefill_tokens": schedule.num_prefill_tokens,
            "num_tokens": schedule.num_batched_tokens, "num_preempted": len(schedule.preempted),
            "num_waiting": len(self.scheduler.waiting),
            "occupancy": len(schedule.scheduled) / self.scheduler.max_num_seqs,
            "free_blocks": self.block_manager.num_free(),
            "num_draft_tokens": sum(len(item.draft_ids) for item in schedule.scheduled),
        })
        new_tokens = [(item.seq, item.seq.output_ids[n:]) for item, n in zip(schedule.scheduled, n_before)]
        return new_tokens, finished

    def _emit_step(self, new_tokens: list[tuple[Sequence, list[int]]], finished: list[Sequence]
                   ) -> list[tuple[Sequence, int]]:
        """Each new token into its request's queue, then the finished requests' outputs."""
        out = []
        for seq, tokens in new_tokens:
            start = seq.num_output_tokens - len(tokens)  # the new tokens are the tail of seq.output_ids
            for i, tok in enumerate(tokens):
                out.append((seq, tok))
                self._emit(seq, tok, last=i == len(tokens) - 1, index=start + i)
        for seq in finished:
            self._retire(seq)
        return out

    def _emit(self, seq: Sequence, token: int | None, last: bool = True, index: int = -1) -> None:
        """Put one StreamEvent into the request's output queue (token None: it was aborted); index: the token's
        position in seq.output_ids (for its logprobs)."""
        sink = self._sinks.get(seq.request_id)
        if sink is None:
            return
        decoder = self._decoders.get(seq.request_id)
        text = ""
        if decoder is not None and token is not None and token not in seq.stop_ids:
            text = decoder.push(token)
        done = seq.is_finished and last
        if done and decoder is not None:
            text += decoder.flush()
        logprob = top = None
        if token is not None and seq.params.logprobs:
            logprob = seq.logprobs[index]
            top = seq.top_logprobs[index] if seq.params.top_logprobs else None
        sink.put(StreamEvent(seq.request_id, token, text, done, seq.finish_reason if done else None, logprob, top))
        if done:
            self._sinks.pop(seq.request_id, None)
            self._decoders.pop(seq.request_id, None)

    def _retire(self, seq: Sequence) -> None:
        if self.drafter is not None:
            self.drafter.release(seq.request_id)
        self._prefill_only.pop(seq.request_id, None)
        self._seqs.pop(seq.request_id, None)
        self._finished[seq.request_id] = seq.to_output(self.tokenizer)

    def pop_output(self, request_id: str) -> RequestOutput:
        with self._lock:
            return self._finished.pop(str(request_id))

    def _pump(self, sink: queue.SimpleQueue | None = None) -> None:
        """Make progress for a waiting consumer: step, unless its queue already got events meanwhile (another
        consumer stepped while this one waited for the lock)."""
        with self._lock:
            if (sink is None or sink.empty()) and self.has_unfinished():
                self.step()

    # ------------------------------------------------------------------------------------------- conveniences

    def _submit(self, prompts, params, chat: bool, sink: queue.SimpleQueue | None = None) -> list[str]:
        params = params_per_prompt(prompts, params)
        with self._lock:
            prepared = []
            for i, (prompt, p) in enumerate(zip(prompts, params)):  # validate every request before queueing any
                try:
                    prepared.append(self._prepare_samples(prompt, p, chat, None, None))
                except (ValueError, TypeError) as e:
                    raise type(e)(f"request {i}: {e}") from None
            return [rid for reqs in prepared for rid in self._enqueue_samples(reqs, sink)]

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 chat: bool = False) -> list[RequestOutput]:
        """Run all prompts (raw text or token ids, continued as is) to completion; outputs in input order, the
        params.n samples of a prompt in a row (n > 1: sample i is seeded with seed + i, see add_samples)."""
        ids = self._submit(prompts, params, chat)
        while any(r not in self._finished for r in ids):
            self._pump()
        return [self.pop_output(r) for r in ids]

    def chat(self, conversations: list[str | list[dict]],
             params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Answer conversations: each a list of {"role", "content"} messages (or a str: one user message), put in
        the chat template with message contents encoded as plain text."""
        if self.tokenizer is None:
            raise ValueError("this LLM has no tokenizer: chat needs one")
        if isinstance(conversations, str) or (conversations and isinstance(conversations[0], dict)):
            raise TypeError("pass a list of conversations, e.g. [[{'role': 'user', 'content': '...'}]]")
        prompts = [self.tokenizer.encode_chat([{"role": "user", "content": c}] if isinstance(c, str) else c)
                   for c in conversations]
        return self.generate(prompts, params)

    def stream(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
               chat: bool = False) -> Iterator[StreamEvent]:
        """Yield each token of these prompts as soon as it is sampled, interleaved across them. Any number of streams
        may run at once (threads or interleaved iterators): each gets exactly its own events. Calling `abort(id)`
        ends that request (a last event with finish_reason "abort"); the others go on."""
        sink: queue.SimpleQueue = queue.SimpleQueue()
        ids = self._submit(prompts, params, chat, sink)
        remaining = set(ids)
        try:
            while remaining:
                try:
                    event = sink.get_nowait()
                except queue.Empty:
                    if not self.has_unfinished() and sink.empty():
                        raise RuntimeError(f"requests {sorted(remaining)} left the engine without a last event")
                    self._pump(sink)
                    continue
                if event.finished:
                    remaining.discard(event.request_id)
                yield event
        finally:  # the caller stopped iterating early: don't leave its requests holding blocks
            with self._lock:
                for r in ids:
                    if r in self._seqs:
                        self.abort(r)
                    self._finished.pop(r, None)

    def num_free_blocks(self) -> int:
        """Blocks a new request can get (with prefix caching: unowned cached blocks included, they are evictable)."""
        return self.block_manager.num_free()

    @property
    def prefix_cache_stats(self):
        """PrefixCacheStats (requests, query/hit tokens, hit rate, evictions), or None without prefix caching."""
        return self.block_manager.allocator.stats if self.block_manager.prefix_caching else None

    def __repr__(self) -> str:
        return (f"LLM(blocks={self.block_manager.num_blocks}x{self.block_manager.block_size}, "
                f"max_num_seqs={self.scheduler.max_num_seqs}, "
                f"max_num_batched_tokens={self.scheduler.max_num_batched_tokens})")


__all__ = ["LLM", "RequestOutput", "SequenceStatus", "StreamEvent", "sample_ids"]
