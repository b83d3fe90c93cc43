"""The continuous batching scheduler (lesson 05): each step, which sequences run and how many tokens each.

Static batching runs a batch until its longest request ends; continuous batching re-decides every step, so
finished sequences free their KV blocks at once and waiting ones take their place. `schedule_step`: running
sequences oldest first (a decode, or a chunked prefill's next chunk), the youngest preempted and recomputed
later when blocks run out; then waiting ones in arrival order, within max_num_seqs and max_num_batched_tokens.
`postprocess_step` appends sampled tokens and retires finished sequences; `reserve_lookahead` /
`rollback_drafts` serve speculative decoding (lesson 10). Plain Python, no tensors. Exercise 05 asks for both.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minillm.engine.block_manager import BlockManager
from minillm.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    """Run tokens all_ids[start : start + num_new_tokens] of `seq` this step."""

    seq: Sequence
    num_new_tokens: int
    start: int = field(init=False)  # num_cached_tokens when scheduled
    samples: bool = field(init=False)  # the chunk reaches the last token: the step samples the next one
    is_decode: bool = field(init=False)  # one new token after a cached history that includes output
    num_lookahead: int = field(default=0, init=False)  # KV slots reserved for draft tokens (lesson 10)
    draft_ids: list[int] = field(default_factory=list, init=False)  # the drafts verified after the new token

    def __post_init__(self) -> None:
        self.start = self.seq.num_cached_tokens
        self.samples = self.start + self.num_new_tokens == self.seq.num_tokens
        self.is_decode = self.num_new_tokens == 1 and self.samples and self.seq.num_output_tokens > 0 \
            and self.start > 0


@dataclass
class Schedule:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens + len(s.draft_ids) for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if not s.is_decode)

    @property
    def num_decodes(self) -> int:
        return sum(s.is_decode for s in self.scheduled)

    def __len__(self) -> int:
        return len(self.scheduled)


def preempt(seq: Sequence, block_manager: BlockManager, waiting: deque[Sequence]) -> None:
    """Free `seq`'s blocks and put it back at the head of `waiting`: it will be recomputed (prompt + output so far)."""
    block_manager.deallocate(seq)
    seq.status = SequenceStatus.WAITING
    seq.num_preemptions += 1
    waiting.appendleft(seq)


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


def reserve_lookahead(schedule: Schedule, block_manager: BlockManager, k: int, max_num_batched_tokens: int) -> None:
    """Speculative decoding (lesson 10): give each decode up to k more KV slots for draft tokens, while free blocks
    and the step's token budget last, and never past the request's max_tokens or the context. Never preempts for
    them: a decode that gets no slots is verified with no drafts (a plain decode step).

    Not for a request with penalties, nor one still under its min_tokens: verification scores draft i with the
    target's raw distribution, but theirs depends on the tokens before it (counts, masked stops), which drafts
    change row by row; a plain decode step applies them exactly (sampling.adjust_logits)."""
    budget = max_num_batched_tokens - schedule.num_batched_tokens
    for item in schedule.scheduled:
        seq = item.seq
        if seq.params.has_penalties or seq.num_output_tokens < seq.params.min_tokens:
            continue
        n = min(k, budget, seq.params.max_tokens - seq.num_output_tokens - 1, seq.max_model_len - seq.num_tokens)
        if item.is_decode and n > 0 and block_manager.can_append(seq, 1 + n):
            block_manager.may_append(seq, 1 + n)
            item.num_lookahead = n
            budget -= n


def rollback_drafts(schedule: Schedule, sampled: list[list[int]], block_manager: BlockManager) -> None:
    """After postprocess: the accepted drafts' keys/values stay cached; the slots of rejected (or never proposed)
    drafts are forgotten and whole blocks past them go back to the pool."""
    for item, tokens in zip(schedule.scheduled, sampled):
        seq = item.seq
        if item.num_lookahead and not seq.is_finished:
            seq.num_cached_tokens += len(tokens) - 1  # every emitted token but the last was a verified draft
            block_manager.truncate(seq, seq.num_cached_tokens)


class Scheduler:
    """Holds the two queues and the block manager; `schedule()` / `postprocess()` run one step's bookkeeping."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int = 16, max_num_batched_tokens: int = 512):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs and max_num_batched_tokens must be >= 1, "
                             f"got {max_num_seqs}, {max_num_batched_tokens}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose KV another engine computed (disaggregation, lesson 13): it holds its blocks already and
        joins the running queue as a decode."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, num_lookahead: int = 0) -> Schedule:
        """This step's work; num_lookahead > 0 also reserves KV slots for that many draft tokens per decode."""
        schedule = schedule_step(self.waiting, self.running, self.block_manager, self.max_num_seqs,
                                 self.max_num_batched_tokens)
        self.num_preemptions += len(schedule.preempted)
        if num_lookahead > 0:
            reserve_lookahead(schedule, self.block_manager, num_lookahead, self.max_num_batched_tokens)
        return schedule

    def postprocess(self, schedule: Schedule, sampled: list[list[int]], now: float) -> list[Sequence]:
        finished = postprocess_step(schedule, sampled, self.running, self.block_manager, now)
        rollback_drafts(schedule, sampled, self.block_manager)
        if self.block_manager.prefix_caching:  # full blocks computed this step become reusable (lesson 12)
            for item in schedule.scheduled:
                if not item.seq.is_finished:
                    self.block_manager.cache_blocks(item.seq)
        return finished

    def abort(self, request_id: str) -> Sequence | None:
        """Cancel a waiting or running request; its blocks return to the pool. None if it is not in flight."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.block_manager.deallocate(seq)
                    seq.status, seq.finish_reason = SequenceStatus.ABORTED, "abort"
                    return seq
        return None
