"""Routing across engine replicas (minillm/cluster/router.py, minillm/cluster/replicas.py; lesson 13).

The policies on crafted request streams, against plain-Python oracles (what round-robin, the minimum of the loads,
the longest block-aligned prefix should give). Then the ReplicaPool with tiny random models on 2 processes: outputs
equal one in-process LLM's greedy outputs under every policy; a slow replica loses nothing; a replica that crashes
or is killed has its requests served elsewhere; no live replica is an error, not a hang; different weights refuse
to start."""

from __future__ import annotations

import functools
import random
import re
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minillm.cache.prefix_cache import block_hashes
from minillm.request import RequestOutput
from minillm.cluster.workers import raise_if_failed
from minillm.cluster.router import (
    LeastOutstandingTokensRouter,
    PrefixAffinityRouter,
    ReplicaState,
    RoundRobinRouter,
    make_router,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def replicas(n: int, alive=None) -> list[ReplicaState]:
    return [ReplicaState(i, alive=True if alive is None else alive[i]) for i in range(n)]


# --------------------------------------------------------------------------------------------- round-robin

@given(st.lists(st.booleans(), min_size=1, max_size=6).filter(any), st.integers(1, 20))
def test_round_robin_cycles_over_live_replicas_only(alive, n_requests):
    reps = replicas(len(alive), alive)
    live_ids = [i for i, a in enumerate(alive) if a]
    router = RoundRobinRouter()
    got = [router.choose([1, 2, 3], 4, reps) for _ in range(n_requests)]
    assert got == [live_ids[k % len(live_ids)] for k in range(n_requests)]


def test_round_robin_skips_a_replica_that_went_down():
    reps, router = replicas(3), RoundRobinRouter()
    assert [router.choose([1], 1, reps) for _ in range(2)] == [0, 1]
    reps[2].alive = False
    assert [router.choose([1], 1, reps) for _ in range(3)] == [0, 1, 0]


@pytest.mark.parametrize("policy", ["round_robin", "least_tokens", "prefix_affinity"])
def test_no_live_replica_is_an_error(policy):
    router = make_router(policy)
    with pytest.raises(RuntimeError, match="no live replica"):
        router.choose([1, 2, 3], 4, replicas(2, [False, False]))
    with pytest.raises(RuntimeError, match="no live replica"):
        router.choose([1, 2, 3], 4, [])


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="round_robin"):
        make_router("random")
    with pytest.raises(ValueError):
        PrefixAffinityRouter(balance_rel=0.5)


# ------------------------------------------------------------------------------------ least outstanding tokens

loads = st.lists(st.tuples(st.integers(1, 300), st.integers(0, 300), st.integers(1, 64), st.integers(0, 64)),
                 max_size=4)


@given(st.lists(st.tuples(st.booleans(), loads), min_size=1, max_size=5).filter(lambda rs: any(a for a, _ in rs)))
def test_least_outstanding_tokens_picks_the_minimum(spec):
    reps, owed = [], {}
    for i, (alive, reqs) in enumerate(spec):
        r = ReplicaState(i, alive)
        total = 0
        for k, (prompt, prefilled, max_tokens, generated) in enumerate(reqs):
            prefilled, generated = min(prefilled, prompt), min(generated, max_tokens)
            r.on_dispatch(f"{i}.{k}", prompt, max_tokens)
            r.on_progress(f"{i}.{k}", generated, prefilled)
            total += (prompt - prefilled) + (max_tokens - generated)
        reps.append(r)
        if alive:
            owed[i] = total
    want = min(owed, key=lambda i: (owed[i], i))  # the fewest tokens owed, ties to the lowest id
    assert LeastOutstandingTokensRouter().choose([5] * 10, 8, reps) == want


def test_least_outstanding_tokens_follows_progress_and_finish():
    reps, router = replicas(2), LeastOutstandingTokensRouter()
    assert router.choose([1], 1, reps) == 0  # tie -> lowest id
    reps[0].on_dispatch("a", 100, 50)  # owes 150
    reps[1].on_dispatch("b", 20, 100)  # owes 120
    assert router.choose([1], 1, reps) == 1
    reps[0].on_progress("a", 10)  # prompt done, 40 to go: owes 40
    assert reps[0].outstanding_tokens == 40
    assert router.choose([1], 1, reps) == 0
    reps[1].on_progress("b", 90)  # owes 10
    assert router.choose([1], 1, reps) == 1
    reps[1].on_finish("b")
    reps[0].on_finish("a")
    assert reps[0].outstanding_tokens == reps[1].outstanding_tokens == 0
    assert router.choose([1], 1, reps) == 0


# ------------------------------------------------------------------------------------------- prefix affinity

def dispatch(router, reps, prompt, max_tokens=8, rid=None) -> int:
    i = router.choose(prompt, max_tokens, reps)
    reps[i].on_dispatch(rid or f"r{sum(r.num_in_flight for r in reps)}", len(prompt), max_tokens)
    router.on_dispatch(i, prompt)
    return i


def group_prompt(group: int, question: int, system_len: int = 64) -> list[int]:
    rng = random.Random(group)
    return [rng.randrange(1000) for _ in range(system_len)] + [1000 + group, 2000 + question]


def test_prefix_affinity_keeps_a_prefix_on_one_replica_and_spreads_prefixes():
    reps, router = replicas(2), PrefixAffinityRouter(block_size=16, balance_abs=10_000)
    first = {g: dispatch(router, reps, group_prompt(g, 0)) for g in (0, 1)}
    assert first[0] != first[1]  # no match anywhere -> the least loaded replica: the second prefix goes elsewhere
    for q in range(1, 6):
        for g in (0, 1):
            assert dispatch(router, reps, group_prompt(g, q)) == first[g]


def test_prefix_affinity_prefers_the_longest_match():
    reps, router = replicas(3), PrefixAffinityRouter(block_size=4, balance_abs=10_000)
    base = list(range(100, 140))
    for i, n in enumerate([8, 24, 16]):  # replica i has seen the first n tokens of base (then other tokens)
        reps[i].on_dispatch("x", 1, 1)  # equal loads
        router.on_dispatch(i, base[:n] + [7] * 8)
    assert router.choose(base + [1, 2], 4, reps) == 1
    assert router.matched_blocks(1, block_hashes(base, 4)) == 24 // 4


def test_prefix_affinity_matches_whole_blocks_only():
    reps, router = replicas(2), PrefixAffinityRouter(block_size=16, balance_abs=10_000)
    shared = list(range(15))  # one token short of a block: names nothing
    reps[1].on_dispatch("busy", 5, 5)  # replica 1 is busier, so only a real match could pull a request there
    router.on_dispatch(1, shared + [99, 98])
    assert router.matched_blocks(1, block_hashes(shared + [1, 2], 16)) == 0
    assert router.choose(shared + [1, 2], 4, reps) == 0  # no match -> least loaded
    router.on_dispatch(1, list(range(16)) + [99])  # a full first block
    assert router.choose(list(range(16)) + [1, 2], 4, reps) == 1


def test_prefix_affinity_falls_back_when_the_match_is_overloaded():
    reps = replicas(2)
    router = PrefixAffinityRouter(block_size=16, balance_abs=500, balance_rel=2.0)
    prompt = group_prompt(0, 0)
    router.on_dispatch(0, prompt)
    reps[0].on_dispatch("a", 400, 0)  # 400 more than replica 1: under the absolute threshold -> affinity wins
    assert router.choose(prompt, 4, reps) == 0
    reps[0].on_dispatch("b", 200, 0)  # 600 ahead and infinitely more: imbalanced -> the least loaded
    assert router.choose(prompt, 4, reps) == 1
    reps[1].on_dispatch("c", 400, 0)  # 200 ahead: balanced enough again
    assert router.choose(prompt, 4, reps) == 0
    reps[1].on_finish("c")
    reps[1].on_dispatch("d", 250, 0)  # 350 ahead (under 500) -> affinity, although 2.4x
    assert router.choose(prompt, 4, reps) == 0


def test_prefix_affinity_forgets_a_dead_replica():
    reps, router = replicas(2), PrefixAffinityRouter(block_size=16)
    prompt = group_prompt(3, 0)
    router.on_dispatch(1, prompt)
    reps[0].on_dispatch("a", 10, 0)  # replica 0 busier: only affinity picks 1
    assert router.choose(prompt, 4, reps) == 1
    reps[1].alive = False
    router.on_replica_down(1)
    assert router.choose(prompt, 4, reps) == 0
    assert router.num_remembered(1) == 0


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5), st.integers(1, 80)), min_size=1, max_size=40),
       st.integers(1, 12))
def test_prefix_affinity_memory_is_bounded_and_evicts_tails_first(stream, max_blocks):
    router = PrefixAffinityRouter(block_size=4, max_blocks=max_blocks)
    for replica, seed, length in stream:
        rng = random.Random(seed)
        prompt = [rng.randrange(50) for _ in range(length)]
        router.on_dispatch(replica, prompt)
        hashes = block_hashes(prompt, 4)
        assert router.num_remembered(replica) <= max_blocks
        # the prompt just routed: its head blocks survive (tail first out), as many as fit
        assert router.matched_blocks(replica, hashes) == min(len(hashes), max_blocks)


# ---------------------------------------------------------------------------------- the pool, tiny models

SPEC = {"tiny": {}, "seed": 0}
TEXT_SPEC = {**SPEC, "tokenizer": "smollm2-135m"}  # the same random model speaking SmolLM2's vocabulary
ENGINE = {"num_blocks": 96, "block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 64}


def workload(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts in 3 groups sharing a 20-token prefix each, with their own tails."""
    rng = random.Random(seed)
    heads = [[rng.randrange(512) for _ in range(20)] for _ in range(3)]
    return [heads[k % 3] + [rng.randrange(512) for _ in range(rng.randrange(1, 9))] for k in range(n)]


@functools.cache
def one_engine_model(spec_key: str):
    from minillm.gguf.loader import load_spec

    return load_spec(TEXT_SPEC if spec_key == "text" else SPEC)


def one_engine(spec_key: str = "text"):
    from minillm.engine import LLM

    return LLM.from_model(*one_engine_model(spec_key), **ENGINE)


def reference(prompts, params, spec_key: str = "text") -> list[list[int]]:
    return [o.token_ids for o in one_engine(spec_key).generate(prompts, params)]


@pytest.fixture(scope="module")
def pool():
    from minillm.cluster.replicas import ReplicaPool

    with ReplicaPool(TEXT_SPEC, 2, "round_robin", ENGINE, timeout=60) as p:
        yield p


@pytest.mark.parametrize("policy", ["round_robin", "least_tokens", "prefix_affinity"])
def test_pool_outputs_equal_one_engine(pool, policy):
    from minillm.sampling import SamplingParams

    prompts = workload(12)
    params = [SamplingParams(max_tokens=2 + k % 5, ignore_eos=True) for k in range(12)]
    pool.reset(policy)
    arrivals = [0.01 * k for k in range(12)] if policy == "round_robin" else None  # else a burst: loads differ
    outs = pool.generate(prompts, params, arrival_times=arrivals)
    assert [o.token_ids for o in outs] == reference(prompts, params)
    assert all(type(o) is RequestOutput for o in outs)
    assert all(o.metrics["error"] is None and o.finish_reason == "length" and o.metrics["attempts"] == 1
               for o in outs)
    assert all(o.metrics["ttft"] > 0 and o.metrics["e2e"] >= o.metrics["ttft"] for o in outs)
    stats = pool.stats()
    assert sum(s["requests"] for s in stats) == 12 and all(s["requests"] > 0 for s in stats)
    assert sum(s["tokens"] for s in stats) == sum(p.max_tokens for p in params)
    where = [o.metrics["replica"] for o in outs]
    if policy == "prefix_affinity":  # each group's prefix lives on one replica
        for g in range(3):
            assert len(set(where[g::3])) == 1
        assert all(s["hit_rate"] > 0 for s in stats)
    if policy == "round_robin":
        assert where == [k % 2 for k in range(12)]


TEXTS = ["The capital of France is", "Write a haiku about caches.", "def fibonacci(n):"]


def per_prompt():
    from minillm.sampling import SamplingParams

    return [SamplingParams(max_tokens=6, ignore_eos=True), SamplingParams(max_tokens=3, ignore_eos=True),
            SamplingParams(max_tokens=9, temperature=0.8, seed=5, ignore_eos=True)]


@pytest.mark.parametrize("chat", [False, True])
def test_pool_takes_text_and_per_prompt_params_like_llm(pool, chat):
    want = one_engine().generate(TEXTS, per_prompt(), chat=chat)
    got = pool.generate(TEXTS, per_prompt(), chat=chat)
    assert [o.prompt_token_ids for o in got] == [o.prompt_token_ids for o in want]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]


def test_pool_streams_llms_stream_events(pool):
    from minillm.engine.output import StreamEvent

    want: dict[str, list] = {}
    for ev in one_engine().stream(TEXTS, per_prompt(), chat=True):
        want.setdefault(ev.request_id, []).append(ev)
    events = list(pool.stream(TEXTS, per_prompt(), chat=True))
    assert all(type(ev) is StreamEvent for ev in events)
    got: dict[str, list] = {}
    for ev in events:
        got.setdefault(ev.request_id, []).append(ev)
    assert got == want  # ids are the prompts' indices in both; every token, text piece and the finishing event


def test_pool_refuses_bad_requests(pool):
    from minillm.sampling import SamplingParams

    with pytest.raises(ValueError, match="request 1"):
        pool.generate([[1, 2], []])
    with pytest.raises(ValueError, match="KV blocks"):
        pool.generate([[1] * 300], SamplingParams(max_tokens=200))
    with pytest.raises(TypeError):
        pool.generate([1, 2, 3])
    with pytest.raises(ValueError, match="request 0: the prompt is empty"):
        pool.generate(["  "])
    assert pool.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].metrics["error"] is None  # still serving


def test_slow_and_crashing_replicas_lose_nothing():
    from minillm.cluster.replicas import Fault, ReplicaPool
    from minillm.sampling import SamplingParams

    prompts = workload(10, seed=1)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = reference(prompts, params, "ids")
    faults = {0: Fault(step_delay_s=0.02), 1: Fault(exit_after_steps=4)}  # 0 is slow; 1 crashes mid-run
    with ReplicaPool(SPEC, 2, "round_robin", ENGINE, timeout=60, faults=faults) as pool:
        outs = pool.generate(prompts, params)
        # the crashed replica's requests went on on replica 0, from where they stopped
        assert [o.token_ids for o in outs] == want
        assert all(o.metrics["error"] is None and o.metrics["replica"] == 0 for o in outs)
        assert any(o.metrics["attempts"] == 2 for o in outs)
        assert [s["alive"] for s in pool.stats()] == [True, False]
        assert [o.token_ids for o in pool.generate(prompts[:3], params)] == want[:3]  # the router avoids 1
        # a request that outlives the timeout ends with an error, not a hang
        pool.timeout = 0.3
        late = pool.generate([prompts[0]], SamplingParams(max_tokens=60, ignore_eos=True), raise_on_error=False)[0]
        assert late.finish_reason == "error" and "timed out" in late.metrics["error"]
        pool.timeout = 60
        pool.reset()  # the aborted request's late events are skipped, not taken for the answer
        assert pool.generate([prompts[1]], params)[0].token_ids == want[1]
        # the last replica killed while it works: a clear error naming the requests, not a hang
        threading.Timer(0.3, pool._procs[0].kill).start()
        with pytest.raises(RuntimeError, match=r"10 of 10 requests failed; .*no live replica"):
            pool.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
        with pytest.raises(RuntimeError, match="no live replica"):
            pool.generate(prompts[:1], params)
    assert all(not p.is_alive() for p in pool._procs)


def test_a_dead_pool_names_every_unserved_request():
    """The only replica crashes with four requests on it and four more queued (arriving in 30 s): all eight end
    at once with an error, and the call's error names each of them."""
    from minillm.cluster.replicas import Fault, ReplicaPool
    from minillm.sampling import SamplingParams

    prompts = workload(8, seed=2)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    with ReplicaPool(SPEC, 1, "round_robin", ENGINE, timeout=60, faults={0: Fault(exit_after_steps=3)}) as pool:
        t0 = time.perf_counter()
        outs = pool.generate(prompts, params, arrival_times=[0.0] * 4 + [30.0] * 4, raise_on_error=False)
        assert time.perf_counter() - t0 < 20  # the queued ones did not wait for their arrival
        assert [o.finish_reason for o in outs] == ["error"] * 8
        assert all("replica 0 exited with code 3" in o.metrics["error"] for o in outs)
        assert all("no live replica" in o.metrics["error"] for o in outs[4:])
        assert [o.metrics["attempts"] for o in outs] == [1] * 4 + [0] * 4
        with pytest.raises(RuntimeError) as err:
            raise_if_failed(outs)
        named = {i for group in re.findall(r"requests? ([\d, ]+):", str(err.value)) for i in group.split(", ")}
        assert named == {str(i) for i in range(8)}, str(err.value)
        with pytest.raises(RuntimeError, match=r"1 of 1 requests failed; request 0: no live replica"):
            pool.generate(prompts[:1], params)


def test_replicas_with_different_weights_refuse_to_start():
    from minillm.cluster.replicas import ReplicaPool

    with pytest.raises(RuntimeError, match="different weights"):
        ReplicaPool([SPEC, {"tiny": {}, "seed": 1}], 2, "round_robin", ENGINE, timeout=60)


def test_a_replica_that_cannot_load_its_model_is_an_error():
    from minillm.cluster.replicas import ReplicaPool

    with pytest.raises(RuntimeError, match="replica 0 failed"):
        ReplicaPool({"tiny": {"n_heads": 3}, "seed": 0}, 1, "round_robin", ENGINE, timeout=60)


@pytest.mark.slow
def test_real_model_replicas_match_one_engine(real_model):
    from minillm.engine import LLM
    from minillm.cluster.replicas import ReplicaPool
    from minillm.sampling import SamplingParams

    model, tok = real_model
    system = {"role": "system", "content": "You are a helpful assistant who answers in one sentence."}
    prompts = [tok.encode_chat([system, {"role": "user", "content": q}])
               for q in ["What is the capital of France?", "What is 2 + 2?", "Name a primary colour."]]
    params = SamplingParams(max_tokens=12)
    want = [o.token_ids for o in LLM.from_model(model, tok, enable_prefix_caching=True).generate(prompts, params)]
    with ReplicaPool("smollm2-135m", 2, "prefix_affinity", timeout=120) as pool:
        outs = pool.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert "Paris" in outs[0].text
