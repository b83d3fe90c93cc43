"""Exercise 05 (reference solutions): one scheduler step, and the static vs continuous batching loops.

Each function is a verbatim copy of minillm's own (see SAME_AS); tests/test_exercise_sync.py keeps them in sync.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TypeVar

# given, not part of the task: the plain-data types and the preemption helper (minillm/engine/scheduler.py)
from minillm.engine.block_manager import BlockManager
from minillm.engine.scheduler import Schedule, ScheduledSeq, preempt
from minillm.engine.sequence import Sequence, SequenceStatus

R = TypeVar("R")

SAME_AS = {
    "schedule_step": "minillm.engine.scheduler",
    "postprocess_step": "minillm.engine.scheduler",
    "static_batching_loop": "minillm.engine.static",
    "continuous_batching_loop": "minillm.engine.static",
}


# task 05.schedule -------------------------------------------------------------------------------------------

def schedule_step(waiting: deque[Sequence], running: deque[Sequence], block_manager: BlockManager,
                  max_num_seqs: int, max_num_batched_tokens: int) -> Schedule:
    """Pick this step's work. Mutates `waiting`/`running` (admissions, preemptions) and block tables."""
    schedule = Schedule()
    budget = max_num_batched_tokens
    # 1. running sequences, oldest first; the youngest are the preemption victims
    pending = list(running)
    running.clear()
    while pending:
        seq = pending.pop(0)
        n_new = min(seq.num_uncached_tokens, budget)
        if n_new == 0:  # the token budget is spent: it keeps its blocks and runs next step
            running.append(seq)
            continue
        while not block_manager.can_append(seq):
            victim = pending.pop() if pending else seq  # most recently admitted first; itself as a last resort
            preempt(victim, block_manager, waiting)
            schedule.preempted.append(victim)
            if victim is seq:
                break
        else:
            block_manager.may_append(seq)
            running.append(seq)
            schedule.scheduled.append(ScheduledSeq(seq, n_new))
            budget -= n_new
    # 2. admit waiting sequences in arrival order (not after a preemption: the pool is short of blocks)
    while not schedule.preempted and waiting and budget > 0 and len(running) < max_num_seqs:
        seq = waiting[0]
        if not block_manager.can_allocate(seq):
            break
        waiting.popleft()
        block_manager.allocate(seq)
        seq.status = SequenceStatus.RUNNING
        n_new = min(seq.num_uncached_tokens, budget)
        running.append(seq)
        schedule.scheduled.append(ScheduledSeq(seq, n_new))
        budget -= n_new
    return schedule


def postprocess_step(schedule: Schedule, sampled: list[list[int]], running: deque[Sequence],
                     block_manager: BlockManager, now: float) -> list[Sequence]:
    """Record what the step computed, append sampled tokens, retire finished sequences. Returns the finished ones.

    `sampled[i]` are the tokens sampled for schedule.scheduled[i], in order: one for a decode or a prompt's last
    chunk, several when a step verifies draft tokens (lesson 10), none for a prefill chunk that did not reach the end
    of its sequence. A sequence stops at the first token that ends it; tokens after that are dropped.
    """
    if len(sampled) != len(schedule.scheduled):
        raise ValueError(f"got {len(sampled)} lists of sampled tokens for {len(schedule.scheduled)} scheduled "
                         f"sequences")
    finished = []
    for item, tokens in zip(schedule.scheduled, sampled):
        seq = item.seq
        if bool(tokens) != item.samples:
            raise ValueError(f"request {seq.request_id}: tokens must be sampled exactly when its chunk ends")
        seq.num_cached_tokens += item.num_new_tokens
        for token in tokens:
            seq.append_token(token, now)
            reason = seq.stop_reason()
            if reason is not None:
                seq.status, seq.finish_reason, seq.finish_time = SequenceStatus.FINISHED, reason, now
                block_manager.deallocate(seq)  # its blocks serve the next admission right away
                running.remove(seq)
                finished.append(seq)
                break
    return finished


# task 05.static_vs_continuous -------------------------------------------------------------------------------

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
