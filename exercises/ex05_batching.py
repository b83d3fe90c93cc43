"""Exercise 05: continuous batching. One scheduler step (admit, preempt, finish) and the two batching loops.

Read lessons/05_continuous_batching.py first. The scheduler works on plain data: Sequence objects (tokens, status,
block table), a BlockManager whose verbs you call (can_allocate / allocate / can_append / may_append / deallocate),
and the `preempt` helper. Grade with `minillm grade 05`.

task_05_real_model drives minillm.LLM's Scheduler with your schedule_step and postprocess_step over SmolLM2-135M:
a seeded workload of six real-text requests on a six-block pool (the reference preempts three times) must come out
token for token as minillm serves it. It stands on exercises 00 (norm, RoPE), 02/03 (prefill attention) and 04
(block allocator, paged decode attention): yours where written, minillm's where not.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TypeVar

# given, not part of the task: the plain-data types and the preemption helper (minillm/engine/scheduler.py)
from minillm.engine.block_manager import BlockManager
from minillm.engine.scheduler import Schedule
from minillm.engine.sequence import Sequence

R = TypeVar("R")


# task 05.schedule -------------------------------------------------------------------------------------------

def schedule_step(waiting: deque[Sequence], running: deque[Sequence], block_manager: BlockManager,
                  max_num_seqs: int, max_num_batched_tokens: int) -> Schedule:
    """Pick this step's work. Mutates `waiting`/`running` (admissions, preemptions) and block tables."""
    raise NotImplementedError(
        "task 05.schedule: running sequences first (oldest first; a decode may need may_append, and"
        " when can_append fails preempt the most recently admitted running sequence), then admit "
        "waiting ones in order while blocks, max_num_seqs and the token budget allow; chunk prompts"
        " with min(num_uncached_tokens, budget)"
    )


def postprocess_step(schedule: Schedule, sampled: list[list[int]], running: deque[Sequence],
                     block_manager: BlockManager, now: float) -> list[Sequence]:
    """Record what the step computed, append sampled tokens, retire finished sequences. Returns the finished ones.

    `sampled[i]` are the tokens sampled for schedule.scheduled[i], in order: one for a decode or a prompt's last
    chunk, several when a step verifies draft tokens (lesson 10), none for a prefill chunk that did not reach the end
    of its sequence. A sequence stops at the first token that ends it; tokens after that are dropped.
    """
    raise NotImplementedError(
        "task 05.schedule: advance num_cached_tokens, append sampled tokens one by one, and for a sequence "
        "whose stop_reason() is not None mark it FINISHED, free its blocks, remove it from running and "
        "drop its remaining tokens"
    )


# task 05.static_vs_continuous -------------------------------------------------------------------------------

def static_batching_loop(requests: list[R], max_batch: int, step_fn: Callable[[list[R]], list[bool]]) -> list[int]:
    """Run `requests` in fixed batches of `max_batch` (arrival order); a batch ends when all its requests are done.

    `step_fn(active)` runs one step for the batch's unfinished requests and returns, per request, whether it
    finished. Returns the number of busy slots at each step: the occupancy timeline (out of max_batch).
    """
    raise NotImplementedError(
        "task 05.static_vs_continuous: take requests max_batch at a time; call step_fn on the "
        "batch's unfinished requests until all are done; record len(active) before each step"
    )


def continuous_batching_loop(requests: list[R], max_batch: int, step_fn: Callable[[list[R]], list[bool]]
                             ) -> list[int]:
    """Refill free slots from the waiting queue before every step (arrival order); same contract as the static loop."""
    raise NotImplementedError(
        "task 05.static_vs_continuous: before each step move waiting requests into free slots "
        "(arrival order); drop finished ones after the step; record len(active) before each step"
    )
