"""`LLM`, the serving engine (lesson 05): requests in, tokens out, continuous batching in between.

    llm = minillm.LLM("smollm2-135m", dtype="bfloat16", max_num_seqs=16)  # or LLM.from_model(model, tok)
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=32))  # also chat, stream

Each step(): schedule -> propose drafts (lesson 10) -> one packed forward -> postprocess -> emit. A finished request
frees its KV blocks at once and a waiting one takes its slot, so no batch idles behind its longest request.
Knobs: config.py; tokens out: output.py; drafts (lesson 10): speculation.py; KV to another engine (13): handoff.py.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Iterator

from minillm.cache.block_allocator import BlockAllocator, blocks_needed
from minillm.cache.kv_transfer import KVHandoff
from minillm.cache.paged import PagedKVCache
from minillm.cache.prefix_cache import PrefixCachingAllocator
from minillm.engine.block_manager import BlockManager
from minillm.engine.config import EngineConfig
from minillm.engine.handoff import PrefillHandoff
from minillm.engine.model_runner import ModelRunner
from minillm.engine.output import OutputCollector, StreamEvent, follow, sample_ids
from minillm.engine.scheduler import Schedule, Scheduler
from minillm.engine.speculation import EngineSpeculation
from minillm.engine.sequence import Sequence
from minillm.request import Request, RequestOutput, make_request, params_per_prompt
from minillm.sampling import SamplingParams
from minillm.speculative.decoding import SpecStats, SpeculativeConfig


class LLM:
    """A paged KV pool, a scheduler and a model runner; an OutputCollector hands tokens out, a PrefillHandoff
    hands KV to another engine. One lock: any thread may call any method."""

    def __init__(self, model_name: str = "smollm2-135m", dtype: str = "float32", device: str = "cpu",
                 num_blocks: int | None = None, kv_cache_bytes: int | None = None, block_size: int = 16,
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 512, attn_backend: str = "sdpa",
                 fuse: bool = False, kv_cache_dtype: str | None = None, weights: str = "dequantized",
                 speculative: SpeculativeConfig | None = None, enable_prefix_caching: bool = False,
                 sparsity: str | None = None, native: bool = False):
        from minillm.api import load_model

        model, tokenizer = load_model(model_name, dtype=dtype, device=device, attn_backend=attn_backend, fuse=fuse,
                                      weights=weights, sparsity=sparsity, native=native)
        self._setup(model, tokenizer, num_blocks=num_blocks, kv_cache_bytes=kv_cache_bytes, block_size=block_size,
                    max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                    kv_cache_dtype=kv_cache_dtype, speculative=speculative,
                    enable_prefix_caching=enable_prefix_caching)

    @classmethod
    def from_model(cls, model, tokenizer=None, num_blocks: int | None = None, kv_cache_bytes: int | None = None,
                   block_size: int = 16, max_num_seqs: int = 16, max_num_batched_tokens: int = 512,
                   kv_cache_dtype: str | None = None, speculative: SpeculativeConfig | None = None,
                   enable_prefix_caching: bool = False) -> LLM:
        """Serve an already loaded model (tokenizer None: prompts must be token ids; text comes back empty).
        The keywords are EngineConfig's (kv_cache_dtype="int8": lesson 07, speculative: lesson 10,
        enable_prefix_caching: lesson 12)."""
        llm = cls.__new__(cls)
        llm._setup(model, tokenizer, num_blocks=num_blocks, kv_cache_bytes=kv_cache_bytes, block_size=block_size,
                   max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                   kv_cache_dtype=kv_cache_dtype, speculative=speculative,
                   enable_prefix_caching=enable_prefix_caching)
        return llm

    def _setup(self, model, tokenizer, **engine) -> None:
        """The one construction path, for both constructors: `engine` are EngineConfig's keywords."""
        self.model, self.tokenizer, self.config = model, tokenizer, (config := EngineConfig(**engine))
        num_blocks, block_size = config.pool_blocks(model), config.block_size
        # one allocator: the block manager decides who owns which block, the cache holds what is in each one
        allocator = (PrefixCachingAllocator if config.enable_prefix_caching else BlockAllocator)(num_blocks,
                                                                                                  block_size)
        self.cache = PagedKVCache(model.config, num_blocks, block_size, model.dtype, model.device,
                                  kv_dtype=config.kv_dtype, n_layers=len(model.layers), allocator=allocator)
        self.block_manager = BlockManager(allocator, prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(model, self.cache, config.max_num_batched_tokens)
        self.speculation = (EngineSpeculation(config.speculative, model, num_blocks, block_size)
                            if config.speculative is not None else None)
        self.drafter = self.speculation.drafter if self.speculation else None
        self.spec_stats = self.speculation.stats if self.speculation else SpecStats()
        self.max_model_len = model.config.max_seq_len
        self.outputs = OutputCollector(tokenizer)
        self.handoff = PrefillHandoff(self.cache, self.block_manager, self.scheduler, self.max_model_len)
        self.step_log: list[dict] = []  # one entry per step: batch occupancy, tokens, preemptions
        self._seqs: dict[str, Sequence] = {}  # in flight
        self._ids = itertools.count()
        self._lock = threading.RLock()  # one step (and one change of the queues) at a time, whoever calls it

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
        if self._in_use(req.request_id):
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.params.n != 1:
            raise ValueError(f"params.n is {req.params.n}: one request is one sequence; add_samples (or generate, "
                             f"chat, stream) queues n samples of a prompt")
        return req

    def _in_use(self, request_id: str) -> bool:
        return request_id in self._seqs or request_id in self.outputs

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

    def _enqueue(self, reqs: list[Request], sink: queue.SimpleQueue | None) -> list[str]:
        """Queue validated requests: one, or the samples of one prompt (_prepare_samples)."""
        first = None
        for req in reqs:
            seq = Sequence.from_request(req, self.max_model_len)
            if self.block_manager.prefix_caching:  # admitted once the first sample has computed the shared prompt
                seq.prefix_source = first
            first = first or seq
            self._seqs[req.request_id] = seq
            self.outputs.attach(req.request_id, sink)
            self.scheduler.add(seq)
        return [req.request_id for req in reqs]

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    chat: bool = False, arrival_time: float | None = None, sink: queue.SimpleQueue | None = None
                    ) -> str:
        """Queue one request; returns its id. Raises ValueError (and queues nothing) for an invalid request.
        `sink`, if given, receives a StreamEvent for each of its tokens (and its end)."""
        with self._lock:
            return self._enqueue([self._prepare(prompt, params, chat, request_id, arrival_time)], sink)[0]

    def add_samples(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    chat: bool = False, arrival_time: float | None = None, sink: queue.SimpleQueue | None = None
                    ) -> list[str]:
        """Queue params.n samples of one prompt (OpenAI's and vLLM's `n`); returns their ids, f"{request_id}-{i}"
        (just request_id when n == 1). Sample i is seeded with seed + i. With prefix caching the prompt is computed
        once: samples 1..n-1 wait for sample 0's prefill and share its KV blocks."""
        with self._lock:
            return self._enqueue(self._prepare_samples(prompt, params, chat, request_id, arrival_time), sink)

    def abort(self, request_id: str) -> bool:
        """Cancel a request in flight (its KV blocks return to the pool). False if it is not in flight."""
        with self._lock:
            seq = self.scheduler.abort(str(request_id))
            if seq is None:
                return False
            seq.finish_time = time.perf_counter()
            self.outputs.emit(seq, None)
            self._retire(seq)
            return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def pop_output(self, request_id: str) -> RequestOutput:
        with self._lock:
            return self.outputs.pop(str(request_id))

    @property
    def _finished(self) -> dict[str, RequestOutput]:  # the outputs nobody popped yet (tests check none is left)
        return self.outputs.finished

    # ---------------------------------------------------------------------------------------------------- steps

    def step(self) -> list[tuple[Sequence, int]]:
        """One engine step: schedule -> propose drafts -> run one packed forward -> postprocess -> emit.
        Returns (sequence, token) for each token emitted."""
        with self._lock:
            schedule, t0 = self._schedule()
            sampled = self.runner.run(schedule, self._propose(schedule))
            new_tokens, finished = self._postprocess(schedule, sampled, t0)
            return self._emit(new_tokens, finished)

    def _schedule(self) -> tuple[Schedule, float]:
        """The scheduler's plan for this step, and when it was made. With speculation (lesson 10) each decode also
        gets KV slots for k drafts, while the batch is small enough for verifying them to be nearly free."""
        k = self.speculation.lookahead(len(self.scheduler.running)) if self.speculation else 0
        schedule = self.scheduler.schedule(k)
        t0 = time.perf_counter()
        for item in schedule.scheduled:
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = t0
        return schedule, t0

    def _propose(self, schedule: Schedule) -> list:
        """Drafts for every decode that got lookahead slots; their distributions, per item (speculation.py)."""
        return self.speculation.propose(schedule) if self.speculation else [None] * len(schedule.scheduled)

    def _postprocess(self, schedule: Schedule, sampled: list[list[int]], t0: float
                     ) -> tuple[list[tuple[Sequence, list[int]]], list[Sequence]]:
        """Hand the sampled tokens to the scheduler, which appends them and retires finished sequences (their
        blocks are freed at once: a prefill-only request's KV is packed into its handoff first, lesson 13).
        Returns each scheduled sequence's new tokens (a stop drops those after it) and the finished ones."""
        if self.speculation:
            self.speculation.observe(schedule)
        now = time.perf_counter()
        self.handoff.pack(schedule, sampled, now)
        n_before = [item.seq.num_output_tokens for item in schedule.scheduled]
        finished = self.scheduler.postprocess(schedule, sampled, now)
        if self.speculation:
            self.speculation.record(schedule, sampled)
        self.step_log.append({
            "t_start": t0, "t_end": now, "num_seqs": len(schedule.scheduled), "num_decodes": schedule.num_decodes,
            "num_prefill_tokens": schedule.num_prefill_tokens, "num_tokens": schedule.num_batched_tokens,
            "num_preempted": len(schedule.preempted), "num_waiting": len(self.scheduler.waiting),
            "occupancy": len(schedule.scheduled) / self.scheduler.max_num_seqs,
            "free_blocks": self.block_manager.num_free(),
            "num_draft_tokens": sum(len(item.draft_ids) for item in schedule.scheduled)})
        new_tokens = [(item.seq, item.seq.output_ids[n:]) for item, n in zip(schedule.scheduled, n_before)]
        return new_tokens, finished

    def _emit(self, new_tokens: list[tuple[Sequence, list[int]]], finished: list[Sequence]
              ) -> list[tuple[Sequence, int]]:
        """Each new token into its request's sink, then the finished requests retire."""
        emitted = self.outputs.emit_step(new_tokens)
        for seq in finished:
            self._retire(seq)
        return emitted

    def _retire(self, seq: Sequence) -> None:
        """A finished or aborted sequence leaves the engine; its output waits for pop_output."""
        if self.speculation:
            self.speculation.release(seq.request_id)
        self.handoff.forget(seq.request_id)
        self._seqs.pop(seq.request_id, None)
        self.outputs.finish(seq)

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
            return [rid for reqs in prepared for rid in self._enqueue(reqs, sink)]

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 chat: bool = False) -> list[RequestOutput]:
        """Run all prompts (raw text or token ids, continued as is) to completion; outputs in input order, the
        params.n samples of a prompt in a row (n > 1: sample i is seeded with seed + i, see add_samples)."""
        ids = self._submit(prompts, params, chat)
        while any(r not in self.outputs for r in ids):
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
        try:
            yield from follow(sink, ids, self._pump, self.has_unfinished)
        finally:  # the caller stopped iterating early: don't leave its requests holding blocks
            with self._lock:
                for r in ids:
                    if r in self._seqs:
                        self.abort(r)
                    self.outputs.discard(r)

    # ------------------------------------------------------------------- disaggregation (lesson 13): handoff.py

    def add_prefill(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a prompt for prefill only: it runs as usual (chunked, prefix-cached) and samples its first token
        with the request's own params/generator; then its KV is packed into a KVHandoff (`pop_handoffs`) and the
        request ends here (max_tokens 1 semantics). The handoff carries the caller's params, unchanged."""
        params = SamplingParams() if params is None else params
        first_only = self.handoff.first_token_params(params)
        with self._lock:
            req = self._prepare(prompt, first_only, False, request_id, arrival_time)
            self.handoff.expect(req, params)
            return self._enqueue([req], None)[0]

    def pop_handoffs(self) -> list[KVHandoff]:
        """The KVHandoffs packed since the last call (their prefill-side requests are finished and forgotten)."""
        with self._lock:
            out = self.handoff.pop()
            for h in out:
                self.outputs.discard(h.request_id)
            return out

    def can_add_prefilled(self, handoff: KVHandoff) -> bool:
        """Are there blocks (and a batch slot) for this handoff now? If not, keep it and try again after a step."""
        return self.handoff.can_add(handoff)

    def add_prefilled(self, handoff: KVHandoff, sink: queue.SimpleQueue | None = None) -> str:
        """Continue a request another engine prefilled: its KV lands in this pool and it joins the running queue
        as a decoding sequence (PrefillHandoff.receive). Raises RuntimeError if the pool lacks blocks now (see
        can_add_prefilled); if anything fails midway its blocks go back to the pool."""
        with self._lock:
            seq = self.handoff.receive(handoff, self._in_use, self.model.device)
            self.outputs.attach(seq.request_id, sink)
            if not seq.is_finished:  # its first token did not end it: on to decoding
                self._seqs[seq.request_id] = seq
                self.scheduler.add_running(seq)
            self.outputs.emit(seq, seq.output_ids[0])
            if seq.is_finished:
                self._retire(seq)
            return seq.request_id

    # ------------------------------------------------------------------------------------------------- state

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


__all__ = ["LLM", "RequestOutput"]
