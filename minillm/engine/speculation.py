"""The engine's side of speculative decoding (lesson 10): which decodes get draft slots this step, their drafts in
one batched call, and, after the forward, which logits row is whose. A decode step reads every weight for one token;
with k drafts the same read verifies up to k + 1, which pays while the batch is small (SpeculativeConfig.max_batch).
Verifying and accepting are the runner's and the scheduler's; drafting is a Drafter's (speculative/drafters.py)."""

from __future__ import annotations

from minillm.engine.scheduler import Schedule
from minillm.speculative.decoding import SpecStats, SpeculativeConfig, make_drafter


class EngineSpeculation:
    """A drafter, the rule for when to use it, and the acceptance counts (SpecStats) of every step."""

    def __init__(self, config: SpeculativeConfig, target, num_blocks: int, block_size: int):
        self.config = config
        # a draft model's own paged cache holds as many tokens as the target's
        self.drafter = make_drafter(config, target, num_blocks, block_size)
        self.stats = SpecStats()

    def lookahead(self, num_running: int) -> int:
        """Draft slots per decode this step: k while few enough sequences decode for verification to be nearly
        free, else 0 (a plain decode step)."""
        return self.config.k if num_running <= self.config.max_batch else 0

    def propose(self, schedule: Schedule) -> list:
        """Drafts for every decode that got lookahead slots (one batched call), put on its ScheduledSeq; returns
        the distribution each item's drafts were drawn from (None where it has none), in schedule order."""
        probs: list = [None] * len(schedule.scheduled)
        items = [i for i, item in enumerate(schedule.scheduled) if item.num_lookahead]
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

    def observe(self, schedule: Schedule) -> None:
        """Right after the forward: which logits rows are whose (the learned drafter keeps their features)."""
        self.drafter.observe([(c.seq.request_id, c.start + c.num_new_tokens + len(c.draft_ids) - n, n)
                              for c in schedule.scheduled for n in [1 + len(c.draft_ids) if c.samples else 0]])

    def record(self, schedule: Schedule, sampled: list[list[int]]) -> None:
        """Count drafted, accepted and emitted tokens of every item that speculated this step."""
        for item, tokens in zip(schedule.scheduled, sampled):
            if item.num_lookahead:
                self.stats.record(len(item.draft_ids), len(tokens) - 1, len(tokens))

    def release(self, request_id: str) -> None:
        self.drafter.release(request_id)
