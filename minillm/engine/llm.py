"""`LLM`: the serving engine's front door. Requests in, tokens out, continuous batching in between.

    llm = minillm.LLM("smollm2-135m", dtype="bfloat16", max_num_seqs=16)
    outs = llm.generate(["The capital of France is", "2 + 2 ="], SamplingParams(max_tokens=32))   # raw prompts
    outs = llm.chat(["What is the capital of France?"], SamplingParams(max_tokens=32))           # chat template
    for ev in llm.stream(["Tell me a story."], SamplingParams(max_tokens=64)): print(ev.text, end="")

Each `step()` asks the Scheduler for work (plain data), has the ModelRunner run it as one packed forward over the
paged KV cache, and hands the sampled tokens back to the scheduler, which retires finished requests at once.
Requests go through the shared request layer (minillm/request.py) and are rejected when submitted (ValueError), so
they never reach a running batch. The engine owns `step()` (one at a time, under a lock) and pushes every token as a
StreamEvent into the output queue of the request it belongs to: any number of consumers (threads, interleaved
iterators) each get all of their own events, whoever happens to drive the step. Lesson 05.

With `speculative=SpeculativeConfig(...)` (lesson 10) a step also reserves KV slots for draft tokens, asks the
drafter for every decoding sequence's guesses at once, and the runner verifies them all in the same packed forward;
each sequence keeps its own number of accepted tokens. Above `max_batch` running sequences it decodes plainly.

Disaggregation (lesson 13) uses two engines: `add_prefill` runs a prompt and its first sample here and packs the
request's KV blocks into a KVHandoff (`pop_handoffs`) before they are freed; `add_prefilled` on another engine puts
that KV into its own blocks and continues decoding (those methods: minillm/engine/handoff.py).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

import torch

from minillm.cache.block_allocator import blocks_needed
from minillm.cache.kv_pool import KVCacheSpec
from minillm.cache.kv_transfer import KVHandoff
from minillm.cache.paged import PagedKVCache
from minillm.request import Request, RequestOutput, make_request, params_per_prompt
from minillm.sampling import SamplingParams
from minillm.speculative.decoding import SpecStats, SpeculativeConfig, make_drafter
from minillm.engine.block_manager import BlockManager
from minillm.engine.handoff import HandoffMixin
from minillm.engine.model_runner import ModelRunner
from minillm.engine.scheduler import Scheduler
from minillm.engine.sequence import Sequence, SequenceStatus

DEFAULT_KV_CACHE_BYTES = 256 << 20


class StreamEvent(NamedTuple):
    request_id: str
    token_id: int | None  # None only in the event that reports an abort
    text: str  # the text this token completes ("" inside a multi-byte character or for a stop token)
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last event


class LLM(HandoffMixin):
    def __init__(self, model_name: str = "smollm2-135m", dtype: str = "float32", device: str = "cpu",
                 num_blocks: int | None = None, kv_cache_bytes: int | None = None, block_size: int = 16,
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 512, attn_backend: str = "sdpa",
                 fuse: bool = False, kv_cache_dtype: str | None = None, weights: str = "dequantized",
                 speculative: SpeculativeConfig | None = None, enable_prefix_caching: bool = False):
        from minillm.api import load_model

        model, tokenizer = load_model(model_name, dtype=dtype, device=device, attn_backend=attn_backend, fuse=fuse,
                                      weights=weights)
        self._setup(model, tokenizer, num_blocks, kv_cache_bytes, block_size, max_num_seqs, max_num_batched_tokens,
                    kv_cache_dtype, speculative, enable_prefix_caching)

    @classmethod
    def from_model(cls, model, tokenizer=None, num_blocks: int | None = None, kv_cache_bytes: int | None = None,
                   block_size: int = 16, max_num_seqs: int = 16, max_num_batched_tokens: int = 512,
                   kv_cache_dtype: str | None = None, speculative: SpeculativeConfig | None = None,
                   enable_prefix_caching: bool = False) -> LLM:
        """Serve an already loaded model (tokenizer None: prompts must be token ids; text comes back empty).
        kv_cache_dtype="int8" stores the KV blocks in int8 with a scale per token and head (lesson 07);
        speculative=SpeculativeConfig(...) drafts and verifies several tokens per decode step (lesson 10);
        enable_prefix_caching=True reuses the KV blocks of prompt prefixes seen before (lesson 12)."""
        llm = cls.__new__(cls)
        llm._setup(model, tokenizer, num_blocks, kv_cache_bytes, block_size, max_num_seqs, max_num_batched_tokens,
                   kv_cache_dtype, speculative, enable_prefix_caching)
        return llm

    def _setup(self, model, tokenizer, num_blocks, kv_cache_bytes, block_size, max_num_seqs, max_num_batched_tokens,
               kv_cache_dtype=None, speculative=None, enable_prefix_caching=False):
        cfg = model.config
        kv_dtypes = {None: None, "int8": torch.int8, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if kv_cache_dtype not in kv_dtypes:
            raise ValueError(f"kv_cache_dtype must be None (the model's dtype) or one of {list(kv_dtypes)[1:]}, "
                             f"got {kv_cache_dtype!r}")
        kv_dtype = kv_dtypes[kv_cache_dtype]  # a float kv dtype is storage only: attention computes in model.dtype
        if num_blocks is None:  # size the pool by a byte budget, no bigger than max_num_seqs full contexts
            budget = DEFAULT_KV_CACHE_BYTES if kv_cache_bytes is None else kv_cache_bytes
            per_block = KVCacheSpec(len(model.layers), cfg.n_kv_heads, cfg.head_dim, 1, block_size, model.dtype,
                                    kv_dtype).bytes_per_block()
            num_blocks = min(budget // per_block, max_num_seqs * blocks_needed(cfg.max_seq_len, block_size))
        elif kv_cache_bytes is not None:
            raise ValueError("give num_blocks or kv_cache_bytes, not both")
        if num_blocks < 1:
            raise ValueError(f"the KV budget holds no block of {block_size} tokens: raise kv_cache_bytes/num_blocks")
        self.model, self.tokenizer = model, tokenizer
        self.cache = PagedKVCache(cfg, int(num_blocks), block_size, model.dtype, model.device, kv_dtype=kv_dtype,
                                  n_layers=len(model.layers), prefix_caching=bool(enable_prefix_caching))
        self.block_manager = BlockManager(self.cache.allocator)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens)
        self.runner = ModelRunner(model, self.cache, max_num_batched_tokens)
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise TypeError(f"speculative must be a SpeculativeConfig, got {type(speculative).__name__}")
        self.speculative = speculative
        # the draft model's own paged cache holds as many tokens as the target's
        self.drafter = make_drafter(speculative, model, int(num_blocks), block_size) if speculative else None
        self.spec_stats = SpecStats()
        self.max_model_len = cfg.max_seq_len
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
        return req

    def _enqueue(self, req: Request, sink: queue.SimpleQueue | None) -> str:
        seq = Sequence.from_request(req, self.max_model_len)
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
        """One scheduler step + one forward. Returns (sequence, sampled token) for each token sampled."""
        with self._lock:
            spec = self.speculative
            speculate = spec is not None and len(self.scheduler.running) <= spec.max_batch
            schedule = self.scheduler.schedule(spec.k if speculate else 0)
            t0 = time.perf_counter()
            for item in schedule.scheduled:
                if item.seq.first_scheduled_time is None:
                    item.seq.first_scheduled_time = t0
            draft_probs = self._propose(schedule) if speculate else None
            sampled = self.runner.run(schedule, draft_probs)
            now = time.perf_counter()
            if self._prefill_only:  # before postprocess frees their blocks
                self._pack_handoffs(schedule, sampled, now)
            n_before = [item.seq.num_output_tokens for item in schedule.scheduled]
            finished = self.scheduler.postprocess(schedule, sampled, now)
            self.step_log.append({
                "t_start": t0, "t_end": now, "num_seqs": len(schedule.scheduled),
                "num_decodes": schedule.num_decodes, "num_prefill_tokens": schedule.num_prefill_tokens,
                "num_tokens": schedule.num_batched_tokens, "num_preempted": len(schedule.preempted),
                "num_waiting": len(self.scheduler.waiting),
                "occupancy": len(schedule.scheduled) / self.scheduler.max_num_seqs,
                "free_blocks": self.block_manager.num_free(),
                "num_draft_tokens": sum(len(item.draft_ids) for item in schedule.scheduled),
            })
            out = []
            for item, tokens in zip(schedule.scheduled, sampled):
                if item.num_lookahead:
                    self.spec_stats.record(len(item.draft_ids), len(tokens) - 1, len(tokens))
            for item, n in zip(schedule.scheduled, n_before):
                new = item.seq.output_ids[n:]  # what postprocess kept (a stop mid-list drops the tokens after it)
                for i, tok in enumerate(new):
                    out.append((item.seq, tok))
                    self._emit(item.seq, tok, last=i == len(new) - 1)
            for seq in finished:
                self._retire(seq)
            return out

    def _propose(self, schedule) -> list:
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

    def _emit(self, seq: Sequence, token: int | None, last: bool = True) -> None:
        """Put one StreamEvent into the request's output queue (token None: it was aborted)."""
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
        sink.put(StreamEvent(seq.request_id, token, text, done, seq.finish_reason if done else None))
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
                    req = self._prepare(prompt, p, chat, None, None)
                except (ValueError, TypeError) as e:
                    raise type(e)(f"request {i}: {e}") from None
                prepared.append(req)
            return [self._enqueue(req, sink) for req in prepared]

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 chat: bool = False) -> list[RequestOutput]:
        """Run all prompts (raw text or token ids, continued as is) to completion; outputs in input order."""
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


__all__ = ["LLM", "RequestOutput", "SequenceStatus", "StreamEvent"]
