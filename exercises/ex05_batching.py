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
from minillm.engine.scheduler import Schedule, ScheduledSeq, preempt  # noqa: F401
from minillm.engine.sequence import Sequence, SequenceStatus  # noqa: F401

R = TypeVar("R")


# task 05.schedule -------------------------------------------------------------------------------------------

def schedule_step(waiting: deque[Sequence], running: deque[Sequence], block_manager: BlockManager,
                  max_num_seqs: int, max_num_batched_tokens: int) -> Schedule:
    """Pick this step's work. Mutates `waiting`/`running` (admissions, preemptions) and block tables.

    Returns a Schedule: `scheduled`, a ScheduledSeq(seq, n) per sequence that runs n tokens this step, and
    `preempted`, the sequences sent back to waiting. The rules, in order:
    1. Running sequences first, oldest first (the order of `running`). Each runs as many of its uncached tokens as
       the step's token budget (max_num_batched_tokens, shared by everything scheduled) still allows; one that gets
       0 stays running, unscheduled, blocks kept. A sequence that needs a new block which the manager cannot give
       (can_append) makes room by preempting the most recently admitted running sequence not yet scheduled, and
       only itself when none is left; the given `preempt` frees a victim's blocks and puts it at the head of
       `waiting`. A sequence that got its room reserves it (may_append) and is scheduled.
    2. Then, only in a step that preempted nothing: waiting sequences from the head, strictly in order (a head that
       does not fit stops admission: never skip it), while the budget is not spent, fewer than max_num_seqs run,
       and the manager can allocate the head's blocks. An admitted sequence gets its blocks, becomes RUNNING, joins
       the end of `running`, and runs min(its uncached tokens, the budget left): a long prompt is chunked.
    Example: budget 8, running [A (a decode)], waiting [B (prompt of 10), C (prompt of 2)], blocks for all: A runs
    1 token, B is admitted with a 7-token chunk, and C waits (the budget is spent), though it would fit in blocks.
    """
    raise NotImplementedError("task 05.schedule: see the docstring; `minillm hint 05 schedule` for hints")


def postprocess_step(schedule: Schedule, sampled: list[list[int]], running: deque[Sequence],
                     block_manager: BlockManager, now: float) -> list[Sequence]:
    """Record what the step computed, append sampled tokens, retire finished sequences. Returns the finished ones.

    `sampled[i]` are the tokens sampled for schedule.scheduled[i], in order: one for a decode or a prompt's last
    chunk, several when a step verifies draft tokens (lesson 10), none for a prefill chunk that did not reach the end
    of its sequence. A sequence stops at the first token that ends it; tokens after that are dropped.

    For each scheduled item: its sequence now has the step's tokens cached (num_cached_tokens grows by the item's
    count); then its sampled tokens are appended one at a time (append_token, with `now`), and the first one after
    which stop_reason() is not None finishes it: status FINISHED, finish_reason and finish_time set, its blocks
    freed at once (block_manager.deallocate), removed from `running`, returned. A ValueError when `sampled` has not
    one list per scheduled item, or a list is non-empty exactly when the item does not sample. Example: max_tokens
    2, one output token so far, sampled [[5, 9]] (a verified draft): 5 is appended, the sequence is finished by
    length, and 9 is dropped.
    """
    raise NotImplementedError("task 05.schedule: see the docstring; `minillm hint 05 schedule` for hints")


# task 05.static_vs_continuous -------------------------------------------------------------------------------

def static_batching_loop(requests: list[R], max_batch: int, step_fn: Callable[[list[R]], list[bool]]) -> list[int]:
    """Run `requests` in fixed batches of `max_batch` (arrival order); a batch ends when all its requests are done.

    `step_fn(active)` runs one step for the batch's unfinished requests and returns, per request, whether it
    finished. Returns the number of busy slots at each step: the occupancy timeline (out of max_batch).

    A slot freed inside a batch stays empty until the whole batch is done. Example: max_batch 2 and requests that
    need 3, 1 and 2 steps: batch [r0, r1] runs 3 steps (2 busy, then 1, 1), then [r2] 2 steps: [2, 1, 1, 1, 1].
    """
    raise NotImplementedError("task 05.static_vs_continuous: see the docstring; `minillm hint 05 "
                              "static_vs_continuous` for hints")


def continuous_batching_loop(requests: list[R], max_batch: int, step_fn: Callable[[list[R]], list[bool]]
                             ) -> list[int]:
    """Refill free slots from the waiting queue before every step (arrival order); same contract as the static loop.

    Example: max_batch 2 and requests that need 3, 1 and 2 steps: step 1 runs r0, r1; r1 finishes and r2 takes its
    slot at step 2; r0 ends after step 3 and r2 after step 3: [2, 2, 2].
    """
    raise NotImplementedError("task 05.static_vs_continuous: see the docstring; `minillm hint 05 "
                              "static_vs_continuous` for hints")
