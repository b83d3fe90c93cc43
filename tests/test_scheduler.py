"""The scheduler and block manager on plain data: no model, no tensors.

A fake "model" stands in for the runner: it keeps, per request, the token ids whose KV it has "cached" and samples a
token that depends on that whole history, so a scheduler that hands out the wrong chunk, forgets to recompute after a
preemption, or loses a token produces a different output than the request run alone.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from minillm.cache.block_allocator import BlockAllocator, blocks_needed
from minillm.engine.block_manager import BlockManager
from minillm.engine.scheduler import ScheduledSeq, Scheduler, postprocess_step, schedule_step
from minillm.engine.sequence import Sequence, SequenceStatus
from minillm.sampling import SamplingParams

VOCAB = 1000


def make_seq(rid, prompt_len, max_tokens, stop_ids=frozenset(), max_model_len=4096, first=1):
    return Sequence(str(rid), list(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens),
                    stop_ids=frozenset(stop_ids), max_model_len=max_model_len)


def fake_token(history: list[int]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(history)) * 2654435761) % VOCAB


class FakeRunner:
    """Emulates the KV cache: checks each chunk starts where the cache ends, samples from the full history."""

    def __init__(self):
        self.cache: dict[str, list[int]] = {}

    def run(self, schedule) -> list[list[int]]:
        out = []
        for item in schedule.scheduled:
            seq = item.seq
            cached = self.cache.setdefault(seq.request_id, [])
            if item.start == 0:
                cached.clear()  # (re)computed from scratch: first admission or after a preemption
            assert item.start == len(cached), f"{seq.request_id}: chunk starts at {item.start}, cache has {len(cached)}"
            assert len(seq.block_table) * seq_block_size(seq) >= item.start + item.num_new_tokens, "writes past blocks"
            cached += seq.all_ids[item.start:item.start + item.num_new_tokens]
            out.append([fake_token(cached)] if item.samples else [])
        return out


_BS: dict[int, int] = {}


def seq_block_size(seq) -> int:
    return _BS[id(seq)]


def solo_output(seq: Sequence) -> list[int]:
    ids, out = list(seq.prompt_ids), []
    while True:
        tok = fake_token(ids)
        out.append(tok)
        ids.append(tok)
        if tok in seq.stop_ids or len(out) >= seq.params.max_tokens or len(ids) >= seq.max_model_len:
            return out


def run_to_completion(sched: Scheduler, seqs, max_steps=100_000, check=None):
    runner = FakeRunner()
    for s in seqs:
        _BS[id(s)] = sched.block_manager.block_size
        sched.add(s)
    steps = 0
    while sched.has_unfinished():
        schedule = sched.schedule()
        if check:
            check(sched, schedule)
        sched.postprocess(schedule, runner.run(schedule), now=float(steps))
        steps += 1
        assert steps < max_steps, "no progress"
    return steps


def make_scheduler(num_blocks, block_size=4, max_num_seqs=8, budget=64):
    return Scheduler(BlockManager(BlockAllocator(num_blocks, block_size)), max_num_seqs, budget)


def test_admission_stops_at_first_request_without_blocks():
    sched = make_scheduler(num_blocks=6, block_size=4)
    a, b, c = make_seq("a", 8, 4), make_seq("b", 12, 4), make_seq("c", 1, 4)
    for s in (a, b, c):
        sched.add(s)
    schedule = sched.schedule()
    # a needs 2 blocks, b needs 3, c needs 1: all fit in 6
    assert [x.seq for x in schedule.scheduled] == [a, b, c]
    assert sched.block_manager.num_free() == 0
    sched2 = make_scheduler(num_blocks=4, block_size=4)
    for s in (make_seq("a", 8, 4), make_seq("b", 12, 4), make_seq("c", 1, 4)):
        sched2.add(s)
    schedule = sched2.schedule()
    # b does not fit (3 > 2 free): FCFS, so c waits behind it rather than overtaking
    assert [x.seq.request_id for x in schedule.scheduled] == ["a"]
    assert [s.request_id for s in sched2.waiting] == ["b", "c"]


def test_max_num_seqs_and_token_budget():
    sched = make_scheduler(num_blocks=100, block_size=4, max_num_seqs=2, budget=10)
    seqs = [make_seq(i, 6, 3) for i in range(3)]
    for s in seqs:
        sched.add(s)
    schedule = sched.schedule()
    # seq 0 gets 6 tokens, seq 1 the remaining 4 (a chunk), seq 2 no slot
    assert [(x.seq.request_id, x.num_new_tokens, x.samples) for x in schedule.scheduled] == [("0", 6, True),
                                                                                              ("1", 4, False)]
    assert schedule.num_batched_tokens <= 10
    sched.postprocess(schedule, [[7], []], now=0.0)
    schedule = sched.schedule()
    # decode of 0 (1 token) and the rest of 1's prompt (2 tokens)
    assert [(x.seq.request_id, x.num_new_tokens, x.start, x.samples) for x in schedule.scheduled] == [
        ("0", 1, 6, True), ("1", 2, 4, True)]
    assert schedule.scheduled[0].is_decode and not schedule.scheduled[1].is_decode


def test_chunked_prefill_samples_only_at_the_end():
    sched = make_scheduler(num_blocks=100, block_size=4, budget=32)
    seq = make_seq("long", 100, 2)
    steps = run_to_completion(sched, [seq])
    assert steps == 4 + 1  # 32 + 32 + 32 + 4 tokens of prefill, then one decode
    assert seq.output_ids == solo_output(seq)


def test_preemption_evicts_most_recent_and_recomputes():
    # 3 blocks of 4 tokens: three 4-token prompts fill the pool; the first decode needs a 4th block
    sched = make_scheduler(num_blocks=3, block_size=4)
    seqs = [make_seq(i, 4, 3) for i in range(3)]
    runner = FakeRunner()
    for s in seqs:
        _BS[id(s)] = 4
        sched.add(s)
    first = sched.schedule()
    assert len(first.scheduled) == 3 and sched.block_manager.num_free() == 0
    sched.postprocess(first, runner.run(first), now=0.0)
    second = sched.schedule()
    # seq 0 needs a block for its 5th token: seq 2 (admitted last) is evicted, then seq 1 needs one too: evicted
    assert [s.request_id for s in second.preempted] == ["2", "1"]
    assert [s.request_id for s in sched.waiting] == ["1", "2"]  # back at the head, in arrival order
    assert all(s.block_table == [] and s.num_cached_tokens == 0 for s in second.preempted)
    assert all(s.status == SequenceStatus.WAITING and s.num_preemptions == 1 for s in second.preempted)
    assert [x.seq.request_id for x in second.scheduled] == ["0"]
    sched.postprocess(second, runner.run(second), now=1.0)
    while sched.has_unfinished():
        sch = sched.schedule()
        sched.postprocess(sch, runner.run(sch), now=2.0)
    for s in seqs:
        assert s.output_ids == solo_output(s)
    assert sched.block_manager.num_free() == 3


def test_finished_sequence_frees_blocks_at_once():
    sched = make_scheduler(num_blocks=10, block_size=4)
    seq = make_seq("x", 5, 1)
    sched.add(seq)
    schedule = sched.schedule()
    assert sched.block_manager.num_free() == 8
    finished = sched.postprocess(schedule, [[3]], now=0.0)
    assert finished == [seq] and seq.status == SequenceStatus.FINISHED and seq.finish_reason == "length"
    assert seq.block_table == [] and sched.block_manager.num_free() == 10 and not sched.running


def test_stop_token_and_context_limit():
    stop_seq = make_seq("s", 4, 50)
    stop_seq.stop_ids = frozenset({solo_output(make_seq("probe", 4, 3))[1]})
    ctx_seq = make_seq("c", 6, 50, max_model_len=9)
    sched = make_scheduler(num_blocks=40)
    run_to_completion(sched, [stop_seq, ctx_seq])
    assert stop_seq.finish_reason == "stop" and len(stop_seq.output_ids) == 2
    assert ctx_seq.finish_reason == "length" and ctx_seq.num_tokens == 9


def test_abort_returns_blocks():
    sched = make_scheduler(num_blocks=10, block_size=4)
    a, b = make_seq("a", 8, 5), make_seq("b", 36, 5)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert sched.block_manager.num_free() == 8 and [s.request_id for s in sched.waiting] == ["b"]
    assert sched.abort("a") is a and a.status == SequenceStatus.ABORTED and a.block_table == []
    assert sched.abort("b") is b and not sched.has_unfinished()
    assert sched.abort("nope") is None
    assert sched.block_manager.num_free() == 10


def test_postprocess_rejects_mismatched_tokens():
    sched = make_scheduler(num_blocks=10, block_size=4, budget=4)
    sched.add(make_seq("a", 8, 5))
    schedule = sched.schedule()
    with pytest.raises(ValueError, match="exactly when its chunk ends"):
        sched.postprocess(schedule, [[5]], now=0.0)
    with pytest.raises(ValueError, match="sampled tokens"):
        sched.postprocess(schedule, [], now=0.0)


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_invariants(seed):
    """Hundreds of requests through a pool small enough to force preemption: nothing lost, nothing leaked."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    max_num_seqs, budget = rng.randint(1, 12), rng.randint(1, 80)
    seqs = []
    for i in range(rng.randint(50, 200)):
        p, m = rng.randint(1, 40), rng.randint(1, 30)
        stops = {rng.randrange(VOCAB)} if rng.random() < 0.3 else set()
        seqs.append(make_seq(i, p, m, stop_ids=stops, first=rng.randrange(VOCAB)))
    peak = max(blocks_needed(s.num_prompt_tokens + s.params.max_tokens - 1, block_size) for s in seqs)
    num_blocks = peak + rng.randint(0, 3 * peak)
    sched = make_scheduler(num_blocks, block_size, max_num_seqs, budget)
    alloc = sched.block_manager.allocator

    def check(sched, schedule):
        assert schedule.num_batched_tokens <= budget and len(sched.running) <= max_num_seqs
        held = [b for s in sched.running for b in s.block_table]
        assert len(held) == len(set(held)) == alloc.num_used(), "blocks leaked or shared"
        assert all(not s.block_table for s in sched.waiting), "a waiting sequence holds blocks"
        assert not set(map(id, sched.running)) & set(map(id, sched.waiting))
        for item in schedule.scheduled:
            assert item.seq.status == SequenceStatus.RUNNING and item.num_new_tokens >= 1

    run_to_completion(sched, seqs, check=check)
    assert alloc.num_free() == num_blocks
    for s in seqs:
        assert s.status == SequenceStatus.FINISHED and s.block_table == []
        assert s.output_ids == solo_output(s), f"request {s.request_id} differs from its solo run"
    assert sched.num_preemptions > 0 or num_blocks > peak  # tight pools do preempt


def test_schedule_step_is_what_the_scheduler_runs():
    waiting, running = deque([make_seq("a", 3, 1)]), deque()
    bm = BlockManager(BlockAllocator(4, 4))
    schedule = schedule_step(waiting, running, bm, 4, 16)
    assert [x.seq.request_id for x in schedule.scheduled] == ["a"] and isinstance(schedule.scheduled[0], ScheduledSeq)
    assert postprocess_step(schedule, [[1]], running, bm, 0.0)[0].request_id == "a" and bm.num_free() == 4
