"""Static batching (lesson 05): the baseline continuous batching beats, and the two batching loops side by
side.

Static batching runs max_batch requests until the longest is done: one that finishes early leaves its slot
idle (a bubble), and the next batch waits. `static_batching_loop` / `continuous_batching_loop` are the two
policies over a fake `step_fn(active) -> finished flags` (exercise 05 asks for them). `StaticBatchEngine` runs
the static one through the `LLM` engine's runner, sampler, paged cache and stop rules, so a comparison
measures the policy alone; it is the favourable baseline (prompts unpadded, a finished row stops computing).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from minillm.cache.block_allocator import blocks_needed
from minillm.cache.paged import PagedKVCache
from minillm.request import RequestOutput, make_request, params_per_prompt
from minillm.sampling import SamplingParams
from minillm.engine.block_manager import BlockManager
from minillm.engine.model_runner import ModelRunner
from minillm.engine.scheduler import Schedule, ScheduledSeq, postprocess_step
from minillm.engine.sequence import Sequence, SequenceStatus

R = TypeVar("R")


def static_batching_loop(requests: list[R], max_batch: int, step_fn: Callable[[list[R]], list[bool]]) -> list[int]:
    """Run `requests` in fixed batches of `max_batch` (arrival order); a batch ends when all its requests are done.

    `step_fn(active)` runs one step for the batch's unfinished requests and returns, per request, whether it
    finished. Returns the number of busy slots at each step: the occupancy timeline (out of max_batch).
    """
    occupancy = []
    for start in range(0, len(requests), max_batch):
        active = list(requests[start:start + max_batch])  # this batch, and only it, until every request is done
        while active:
            occupancy.append(len(active))
            done = step_fn(active)
            active = [r for r, finished in zip(active, done) if not finished]
    return occupancy


def continuous_batching_loop(requests: list[R], max_batch: int, step_fn: Callable[[list[R]], list[bool]]
                             ) -> list[int]:
    """Refill free slots from the waiting queue before every step (arrival order); same contract as the static loop."""
    waiting = deque(requests)
    active: list[R] = []
    occupancy = []
    while waiting or active:
        while waiting and len(active) < max_batch:  # a slot freed by the last step is refilled right away
            active.append(waiting.popleft())
        occupancy.append(len(active))
        done = step_fn(active)
        active = [r for r, finished in zip(active, done) if not finished]
    return occupancy


class StaticBatchEngine:
    """The real model under static batching: same runner, sampler, cache and stop rules as minillm.LLM."""

    def __init__(self, model, tokenizer=None, max_batch: int = 16, block_size: int = 16):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model, self.tokenizer, self.max_batch, self.block_size = model, tokenizer, max_batch, block_size
        self.step_log: list[dict] = []

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        params = params_per_prompt(prompts, params)
        if not prompts:
            raise ValueError("give at least one prompt")
        ctx = self.model.config.max_seq_len
        now = time.perf_counter()
        seqs = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                req = make_request(prompt, p, self.tokenizer, self.model.config, self.model.device, str(i),
                                   arrival_time=now)
                if req.params.max_tokens < 1:
                    raise ValueError("max_tokens must be >= 1")
                if req.params.n != 1:  # the baseline runs each prompt once; minillm.LLM samples n
                    raise ValueError("n > 1 (samples of a prompt) is for minillm.LLM; pass the prompt n times")
            except (ValueError, TypeError) as e:
                raise type(e)(f"request {i}: {e}") from None
            seqs.append(Sequence.from_request(req, ctx))
        # room for a full batch of the longest request: static batching reserves for the worst case
        longest = max(len(s.prompt_ids) + s.params.max_tokens for s in seqs)
        cache = PagedKVCache(self.model.config, self.max_batch * blocks_needed(longest, self.block_size),
                             self.block_size, self.model.dtype, self.model.device, n_layers=len(self.model.layers))
        block_manager, runner = BlockManager(cache.allocator), ModelRunner(self.model, cache)

        def step(active: list[Sequence]) -> list[bool]:
            t0 = time.perf_counter()
            schedule = Schedule()
            for seq in active:
                if seq.status == SequenceStatus.WAITING:  # first step of its batch: prefill the whole prompt
                    block_manager.allocate(seq)
                    seq.status, seq.first_scheduled_time = SequenceStatus.RUNNING, t0
                else:
                    block_manager.may_append(seq)
                schedule.scheduled.append(ScheduledSeq(seq, seq.num_uncached_tokens))
            sampled = runner.run(schedule)
            finished = postprocess_step(schedule, sampled, deque(active), block_manager, time.perf_counter())
            self.step_log.append({"t_start": t0, "t_end": time.perf_counter(), "num_seqs": len(active),
                                  "occupancy": len(active) / self.max_batch,
                                  "num_tokens": schedule.num_batched_tokens})
            return [seq in finished for seq in active]

        static_batching_loop(seqs, self.max_batch, step)
        return [seq.to_output(self.tokenizer) for seq in seqs]
