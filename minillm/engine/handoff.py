"""The disaggregation seam of the engine (lesson 13): hand a request's KV cache from one LLM to another.

    prefill_llm.add_prefill(prompt, params)   # runs the prompt (chunked, prefix-cached) and its first sample
    for h in prefill_llm.pop_handoffs():      # KVHandoff: prompt, first token, params, generator state, KV
        decode_llm.add_prefilled(h)           # own blocks, unpack, straight into the running queue

`LLM` inherits these methods; LLM.step calls `_pack_handoffs` after the forward, before finished blocks are
freed. KV packing: cache/kv_transfer.py; processes and the wire: serving/disagg.py.
"""

from __future__ import annotations

import dataclasses
import queue
import time

import torch

from minillm.cache import kv_transfer
from minillm.cache.block_allocator import blocks_needed
from minillm.cache.kv_transfer import KVHandoff
from minillm.engine.sequence import Sequence, SequenceStatus
from minillm.request import finish_reason
from minillm.sampling import SamplingParams


class HandoffMixin:
    """add_prefill / pop_handoffs on the prefill side, can_add_prefilled / add_prefilled on the decode side."""

    def add_prefill(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a prompt for prefill only: it runs as usual (chunked, prefix-cached) and samples its first token
        with the request's own params/generator; then its KV is packed into a KVHandoff (`pop_handoffs`) and the
        request ends here (max_tokens 1 semantics). The handoff carries the caller's params, unchanged."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        with self._lock:  # the pool only needs the prompt's blocks: the decode engine checks the peak
            first_only = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
            req = self._prepare(prompt, first_only, False, request_id, arrival_time)
            if len(req.prompt_ids) + params.max_tokens > self.max_model_len:
                raise ValueError(f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                                 f"the context window ({self.max_model_len}): lower max_tokens")
            self._prefill_only[req.request_id] = params
            return self._enqueue(req, None)

    def _pack_handoffs(self, schedule, sampled: list[list[int]], now: float) -> None:
        for item, tokens in zip(schedule.scheduled, sampled):
            seq, params = item.seq, self._prefill_only.get(item.seq.request_id)
            if params is None or not tokens:
                continue
            n = item.start + item.num_new_tokens  # the prompt, all computed now
            payload = kv_transfer.pack_kv_blocks(self.cache.pool, seq.block_table, n)
            first = [tokens[0]]
            self._handoffs.append(KVHandoff(
                seq.request_id, list(seq.prompt_ids), first, params, seq.stop_ids,
                seq.generator.get_state() if seq.generator is not None else None, n, self.block_manager.block_size,
                payload, kv_transfer.kv_checksum(payload), kv_transfer.payload_nbytes(payload),
                finish_reason(first, seq.stop_ids, params.max_tokens, n + 1, seq.max_model_len),
                seq.arrival_time, now))

    def pop_handoffs(self) -> list[KVHandoff]:
        """The KVHandoffs packed since the last call (their prefill-side requests are finished and forgotten)."""
        with self._lock:
            out, self._handoffs = self._handoffs, []
            for h in out:
                self._finished.pop(h.request_id, None)
            return out

    def _check_handoff(self, h: KVHandoff) -> None:
        if not isinstance(h, KVHandoff):
            raise TypeError(f"add_prefilled takes a KVHandoff, got {type(h).__name__}")
        bs = self.block_manager.block_size
        if h.block_size != bs:
            raise ValueError(f"request {h.request_id}: KV packed in blocks of {h.block_size} tokens, this engine uses "
                             f"{bs}: build the prefill and decode engines with the same block_size")
        if h.num_computed_tokens != len(h.prompt_ids) or len(h.output_ids) != 1:
            raise ValueError(f"request {h.request_id}: a handoff holds a prompt's KV and its first token, got "
                             f"{h.num_computed_tokens} computed tokens for {len(h.prompt_ids)} prompt tokens and "
                             f"{len(h.output_ids)} output tokens")
        kv_transfer.check_payload(self.cache.pool, blocks_needed(h.num_computed_tokens, bs), h.payload)
        if kv_transfer.kv_checksum(h.payload) != h.checksum:
            raise ValueError(f"request {h.request_id}: the KV payload's checksum differs from the sender's: it was "
                             f"corrupted in transfer")
        if h.request_id in self._seqs or h.request_id in self._finished:
            raise ValueError(f"request id {h.request_id!r} is already in use")
        peak = blocks_needed(len(h.prompt_ids) + h.params.max_tokens - 1, bs)
        if peak > self.block_manager.num_blocks or len(h.prompt_ids) + h.params.max_tokens > self.max_model_len:
            raise ValueError(f"request {h.request_id}: prompt + max_tokens need {peak} KV blocks and "
                             f"{len(h.prompt_ids) + h.params.max_tokens} tokens of context; this engine has "
                             f"{self.block_manager.num_blocks} blocks and a context of {self.max_model_len}")

    def can_add_prefilled(self, handoff: KVHandoff) -> bool:
        """Are there blocks (and a batch slot) for this handoff now? If not, keep it and try again after a step."""
        if handoff.finish_reason is not None:
            return True
        n = blocks_needed(len(handoff.prompt_ids) + 1, self.block_manager.block_size)
        return len(self.scheduler.running) < self.scheduler.max_num_seqs and \
            self.block_manager.allocator.can_allocate(n)

    def add_prefilled(self, handoff: KVHandoff, sink: queue.SimpleQueue | None = None) -> str:
        """Continue a request another engine prefilled: validate the handoff, allocate blocks for its prompt and
        first token, write the KV into them, and put it in the running queue as a decoding sequence (its first
        token is already output: it counts for max_tokens and stop conditions). Raises RuntimeError if the pool
        lacks blocks now (see can_add_prefilled); if anything fails midway its blocks go back to the pool."""
        with self._lock:
            h = handoff
            self._check_handoff(h)
            seq = Sequence(h.request_id, list(h.prompt_ids), h.params, stop_ids=frozenset(h.stop_ids),
                           max_model_len=self.max_model_len, arrival_time=h.arrival_time,
                           output_ids=list(h.output_ids), token_times=[h.first_token_time])
            if h.generator_state is not None:
                seq.generator = torch.Generator(device=self.model.device)
                seq.generator.set_state(h.generator_state)
            if sink is not None:
                self._sinks[seq.request_id] = sink
                if self.tokenizer is not None:
                    self._decoders[seq.request_id] = self.tokenizer.stream_decoder()
            if h.finish_reason is not None:  # the first token ended it: nothing to decode, no blocks needed
                seq.status, seq.finish_reason, seq.finish_time = SequenceStatus.FINISHED, h.finish_reason, \
                    time.perf_counter()
                self._emit(seq, seq.output_ids[0])
                self._retire(seq)
                return seq.request_id
            if not self.can_add_prefilled(h):
                self._sinks.pop(seq.request_id, None)
                self._decoders.pop(seq.request_id, None)
                raise RuntimeError(f"request {h.request_id}: no free KV blocks or batch slot for it now "
                                   f"({self.num_free_blocks()} free blocks, {len(self.scheduler.running)} running): "
                                   f"keep the handoff and retry after a step")
            table = self.block_manager.table(seq)
            table.grow(seq.num_tokens)  # prompt + first token
            try:
                n_blocks = blocks_needed(h.num_computed_tokens, table.block_size)
                kv_transfer.unpack_kv_blocks(self.cache.pool, table.block_ids[:n_blocks], h.payload)
            except BaseException:
                table.free()
                self._sinks.pop(seq.request_id, None)
                self._decoders.pop(seq.request_id, None)
                raise
            seq.num_cached_tokens = h.num_computed_tokens
            self._seqs[seq.request_id] = seq
            self.scheduler.add_running(seq)
            self._emit(seq, seq.output_ids[0])
            return seq.request_id
