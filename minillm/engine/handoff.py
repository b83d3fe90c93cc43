"""The disaggregation seam of the engine (lesson 13): hand a request's KV cache from one LLM to another.

    prefill_llm.add_prefill(prompt, params)   # runs the prompt (chunked, prefix-cached) and its first sample
    for h in prefill_llm.pop_handoffs():      # KVHandoff: prompt, first token, params, generator state, KV
        decode_llm.add_prefilled(h)           # own blocks, unpack, straight into the running queue

Prefill and decode then run on engines sized for each, and a long prompt no longer stalls other requests' decode.
LLM holds a PrefillHandoff; KV packing: cache/kv_transfer.py; processes and the wire: cluster/disagg.py.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from minillm.cache import kv_transfer
from minillm.cache.block_allocator import blocks_needed
from minillm.cache.kv_transfer import KVHandoff
from minillm.cache.paged import PagedKVCache
from minillm.engine.block_manager import BlockManager
from minillm.engine.scheduler import Schedule, Scheduler
from minillm.engine.sequence import Sequence, SequenceStatus
from minillm.request import Request, finish_reason
from minillm.sampling import SamplingParams


class PrefillHandoff:
    """One engine's side of the handoff. Prefill side: which requests are prefill-only (with the caller's params),
    and the KVHandoffs packed for them once their first token is sampled. Decode side: check a handoff against
    this engine's pool and land its KV there. The engine's lock guards every call."""

    def __init__(self, cache: PagedKVCache, block_manager: BlockManager, scheduler: Scheduler, max_model_len: int):
        self.cache, self.block_manager, self.scheduler = cache, block_manager, scheduler
        self.max_model_len = max_model_len
        self.prefill_only: dict[str, SamplingParams] = {}  # add_prefill's requests -> the caller's params
        self.packed: list[KVHandoff] = []  # packed when their first token was sampled, until pop

    # ------------------------------------------------------------------------------------------------ prefill side

    @staticmethod
    def first_token_params(params: SamplingParams) -> SamplingParams:
        """What a prefill-only request runs with: the caller's params, ending after the first token."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))

    def expect(self, req: Request, params: SamplingParams) -> None:
        """Mark a request prefill-only; its handoff will carry `params`, the caller's. Its pool only needs the
        prompt's blocks (the decode engine checks the peak), but the whole answer must fit the context."""
        if len(req.prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"the context window ({self.max_model_len}): lower max_tokens")
        self.prefill_only[req.request_id] = params

    def pack(self, schedule: Schedule, sampled: list[list[int]], now: float) -> None:
        """Pack the KV of each prefill-only request that sampled its first token this step (before the engine
        frees its blocks)."""
        if not self.prefill_only:
            return
        for item, tokens in zip(schedule.scheduled, sampled):
            seq, params = item.seq, self.prefill_only.get(item.seq.request_id)
            if params is None or not tokens:
                continue
            n = item.start + item.num_new_tokens  # the prompt, all computed now
            payload = kv_transfer.pack_kv_blocks(self.cache.pool, seq.block_table, n)
            first = [tokens[0]]
            self.packed.append(KVHandoff(
                seq.request_id, list(seq.prompt_ids), first, params, seq.stop_ids,
                seq.generator.get_state() if seq.generator is not None else None, n, self.block_manager.block_size,
                payload, kv_transfer.kv_checksum(payload), kv_transfer.payload_nbytes(payload),
                finish_reason(first, seq.stop_ids, params.max_tokens, n + 1, seq.max_model_len),
                seq.arrival_time, now))

    def pop(self) -> list[KVHandoff]:
        out, self.packed = self.packed, []
        return out

    def forget(self, request_id: str) -> None:
        self.prefill_only.pop(request_id, None)

    # ------------------------------------------------------------------------------------------------- decode side

    def check(self, h: KVHandoff, in_use: Callable[[str], bool]) -> None:
        """Refuse a handoff this engine cannot continue (in_use: is a request id taken here)."""
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
        if in_use(h.request_id):
            raise ValueError(f"request id {h.request_id!r} is already in use")
        peak = blocks_needed(len(h.prompt_ids) + h.params.max_tokens - 1, bs)
        if peak > self.block_manager.num_blocks or len(h.prompt_ids) + h.params.max_tokens > self.max_model_len:
            raise ValueError(f"request {h.request_id}: prompt + max_tokens need {peak} KV blocks and "
                             f"{len(h.prompt_ids) + h.params.max_tokens} tokens of context; this engine has "
                             f"{self.block_manager.num_blocks} blocks and a context of {self.max_model_len}")

    def can_add(self, handoff: KVHandoff) -> bool:
        """Are there blocks (and a batch slot) for this handoff now?"""
        if handoff.finish_reason is not None:
            return True
        n = blocks_needed(len(handoff.prompt_ids) + 1, self.block_manager.block_size)
        return len(self.scheduler.running) < self.scheduler.max_num_seqs and \
            self.block_manager.allocator.can_allocate(n)

    def receive(self, h: KVHandoff, in_use: Callable[[str], bool], device) -> Sequence:
        """The decoding sequence a handoff continues (in_use: is a request id taken here), its KV written into
        blocks of this pool. Its first token is already output (it counts for max_tokens and stop conditions) and
        its generator is where the prefill engine left it; if that token ended it, it is finished and owns no
        blocks. Raises RuntimeError if the pool lacks blocks now; if anything fails midway they go back to it."""
        self.check(h, in_use)
        seq = Sequence(h.request_id, list(h.prompt_ids), h.params, stop_ids=frozenset(h.stop_ids),
                       max_model_len=self.max_model_len, arrival_time=h.arrival_time,
                       output_ids=list(h.output_ids), token_times=[h.first_token_time])
        if h.generator_state is not None:
            seq.generator = torch.Generator(device=device)
            seq.generator.set_state(h.generator_state)
        if h.finish_reason is not None:  # nothing to decode, no blocks needed
            seq.status, seq.finish_reason, seq.finish_time = SequenceStatus.FINISHED, h.finish_reason, \
                time.perf_counter()
            return seq
        if not self.can_add(h):
            raise RuntimeError(f"request {h.request_id}: no free KV blocks or batch slot for it now "
                               f"({self.block_manager.num_free()} free blocks, {len(self.scheduler.running)} "
                               f"running): keep the handoff and retry after a step")
        table = self.block_manager.table(seq)
        table.grow(seq.num_tokens)  # prompt + first token
        try:
            n_blocks = blocks_needed(h.num_computed_tokens, table.block_size)
            kv_transfer.unpack_kv_blocks(self.cache.pool, table.block_ids[:n_blocks], h.payload)
        except BaseException:
            table.free()
            raise
        seq.num_cached_tokens = h.num_computed_tokens
        return seq

__all__ = ["PrefillHandoff"]
