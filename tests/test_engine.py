"""The serving engine end to end: every request's output equals the same request run alone (minillm.generate's
single-sequence loop on a contiguous cache, an independent path), under batching, chunked prefill and preemption."""

from __future__ import annotations

import random
import time

import pytest
import torch

from minillm.api import generate_ids
from minillm.cache.prefix_cache import PrefixCachingAllocator
from minillm.config import ModelConfig
from minillm.engine import LLM, EngineConfig
from minillm.engine.static import StaticBatchEngine, continuous_batching_loop, static_batching_loop
from minillm.model import Transformer
from minillm.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(vocab_size=256, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, n_layers=2, max_seq_len=96)
    return Transformer(cfg).eval()


def solo(model, ids, params, stop_ids=frozenset()):
    return list(generate_ids(model, ids, params, set(stop_ids)))


def random_requests(rng, n, vocab, max_prompt=24, max_out=20, sampled=True):
    prompts, params = [], []
    for _ in range(n):
        prompts.append([rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))])
        temp = rng.choice([0.0, 0.0, 0.7, 1.3]) if sampled else 0.0
        params.append(SamplingParams(max_tokens=rng.randint(1, max_out), temperature=temp, seed=rng.randrange(1000),
                                     top_k=rng.choice([None, 5, 50]), top_p=rng.choice([1.0, 0.9]),
                                     stop_ids={rng.randrange(vocab)} if rng.random() < 0.3 else set()))
    return prompts, params


@pytest.mark.parametrize("block_size,num_blocks,max_seqs,budget", [(4, 12, 4, 16), (16, 64, 16, 512), (1, 45, 8, 7)])
def test_outputs_equal_solo_runs(tiny, block_size, num_blocks, max_seqs, budget):
    rng = random.Random(block_size)
    prompts, params = random_requests(rng, 30, tiny.config.vocab_size)
    llm = LLM.from_model(tiny, num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_seqs,
                         max_num_batched_tokens=budget)
    outs = llm.generate(prompts, params)
    for i, (p, sp, out) in enumerate(zip(prompts, params, outs)):
        assert out.request_id is not None and out.prompt_token_ids == p
        assert out.token_ids == solo(tiny, p, sp), f"request {i} differs from its solo run"
        reason = "stop" if out.token_ids[-1] in sp.stop_ids else "length"
        assert out.finish_reason == reason
    assert llm.num_free_blocks() == num_blocks
    assert max(s["num_seqs"] for s in llm.step_log) <= max_seqs
    assert max(s["num_tokens"] for s in llm.step_log) <= budget


def test_stress_preemption_hundreds_of_requests(tiny):
    """A pool barely larger than one request's peak: preemption happens constantly and nothing is lost."""
    rng = random.Random(1234)
    prompts, params = random_requests(rng, 200, tiny.config.vocab_size, max_prompt=30, max_out=24)
    llm = LLM.from_model(tiny, num_blocks=16, block_size=4, max_num_seqs=12, max_num_batched_tokens=48)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    assert time.perf_counter() - t0 < 60
    assert llm.scheduler.num_preemptions > 20, "the pool was meant to force preemption"
    assert any(o.metrics["num_preemptions"] > 0 for o in outs)
    for i, (p, sp, out) in enumerate(zip(prompts, params, outs)):
        assert out.token_ids == solo(tiny, p, sp), f"request {i} differs from its solo run"
    assert llm.num_free_blocks() == 16 and not llm.has_unfinished()


def test_context_limit_and_pool_rejections(tiny):
    ctx = tiny.config.max_seq_len
    llm = LLM.from_model(tiny, num_blocks=10, block_size=4)
    keep = llm.add_request([1, 2, 3], SamplingParams(max_tokens=5))
    bad = [
        ([], SamplingParams(), "empty"),
        ("   ", SamplingParams(), "empty"),
        ("hello", SamplingParams(), "no tokenizer"),
        ([1] * ctx, SamplingParams(max_tokens=1), "context window"),
        ([1] * 10, SamplingParams(max_tokens=ctx - 5), "lower max_tokens to at most 86"),
        ([1] * 20, SamplingParams(max_tokens=30), "KV blocks"),
        ([1, 999], SamplingParams(), r"\[0, 256\)"),
        ([1, 2], "greedy", "SamplingParams"),
    ]
    for prompt, sp, msg in bad:
        with pytest.raises((ValueError, TypeError), match=msg):
            llm.add_request(prompt, sp)
    sp = SamplingParams(max_tokens=4)
    sp.temperature = -1.0  # mutated after construction: checked again at submission
    with pytest.raises(ValueError, match="temperature"):
        llm.add_request([1, 2], sp)
    zero = SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        llm.add_request([1, 2], zero)
    with pytest.raises(ValueError, match="request 1"):  # generate validates all before queueing any
        llm.generate([[4, 5], []], SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="already in use"):
        llm.add_request([1], SamplingParams(max_tokens=1), request_id=keep)
    while llm.has_unfinished():  # the valid request is served as if nothing happened
        llm.step()
    out = llm.pop_output(keep)
    assert out.token_ids == solo(tiny, [1, 2, 3], SamplingParams(max_tokens=5))
    assert llm.num_free_blocks() == 10


def test_engine_config_gathers_the_knobs_and_one_allocator_serves_both(tiny):
    llm = LLM.from_model(tiny, num_blocks=12, block_size=4, max_num_seqs=3, enable_prefix_caching=True)
    assert llm.config == EngineConfig(num_blocks=12, block_size=4, max_num_seqs=3, enable_prefix_caching=True)
    assert isinstance(llm.cache.allocator, PrefixCachingAllocator)
    assert llm.block_manager.allocator is llm.cache.allocator  # the engine built it, both use it
    sized = LLM.from_model(tiny, kv_cache_bytes=1 << 20, block_size=4)
    assert sized.config.pool_blocks(tiny) == sized.block_manager.num_blocks > 0
    bad = (({"kv_cache_dtype": "int4"}, "kv_cache_dtype"), ({"kv_cache_bytes": 16}, "holds no block"),
           ({"num_blocks": 4, "kv_cache_bytes": 64}, "not both"))
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            LLM.from_model(tiny, **kw)
    with pytest.raises(TypeError, match="SpeculativeConfig"):
        EngineConfig(speculative="ngram")


def test_abort_returns_blocks_and_others_continue(tiny):
    rng = random.Random(7)
    prompts, params = random_requests(rng, 6, tiny.config.vocab_size, sampled=False)
    params = [SamplingParams(max_tokens=15, ignore_eos=True) for _ in prompts]
    llm = LLM.from_model(tiny, num_blocks=40, block_size=4, max_num_seqs=4)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    for _ in range(3):
        llm.step()
    running_before = llm.num_free_blocks()
    victim = next(s for s in llm.scheduler.running)
    held = len(victim.block_table)
    assert held > 0 and llm.abort(victim.request_id)
    assert llm.num_free_blocks() == running_before + held
    assert llm.abort(ids[-1])  # still waiting: aborting it is fine too
    assert not llm.abort("no-such-request")
    while llm.has_unfinished():
        llm.step()
    for rid, p, sp in zip(ids, prompts, params):
        out = llm.pop_output(rid)
        if rid in (victim.request_id, ids[-1]):
            assert out.finish_reason == "abort"
        else:
            assert out.token_ids == solo(tiny, p, sp)
    assert llm.num_free_blocks() == 40


def test_stream_interleaves_and_matches_generate(tiny):
    rng = random.Random(3)
    prompts, params = random_requests(rng, 5, tiny.config.vocab_size)
    llm = LLM.from_model(tiny, num_blocks=60, block_size=4, max_num_seqs=3)
    tokens: dict[str, list[int]] = {}
    order = []
    for ev in llm.stream(prompts, params):
        tokens.setdefault(ev.request_id, []).append(ev.token_id)
        order.append(ev.request_id)
        assert ev.finished == (ev.token_id in params[int(ev.request_id)].stop_ids or
                               len(tokens[ev.request_id]) == params[int(ev.request_id)].max_tokens)
    assert len(set(order[:3])) > 1, "tokens of different requests should interleave"
    for rid, toks in tokens.items():
        assert toks == solo(tiny, prompts[int(rid)], params[int(rid)])
    # leaving a stream early aborts its requests and frees their blocks
    for _ in llm.stream(prompts, params):
        break
    assert llm.num_free_blocks() == 60 and not llm.has_unfinished()


def test_metrics_are_ordered(tiny):
    llm = LLM.from_model(tiny, num_blocks=40, block_size=4)
    outs = llm.generate([[1, 2, 3], [4] * 20], SamplingParams(max_tokens=6, ignore_eos=True))
    for o in outs:
        m = o.metrics
        assert 0 <= m["queue_time"] <= m["ttft"] <= m["e2e"] and len(m["itl"]) == 5
        assert m["tpot"] == pytest.approx(sum(m["itl"]) / 5)
    assert all(0 < s["occupancy"] <= 1 for s in llm.step_log)


def test_static_engine_matches_solo(tiny):
    rng = random.Random(11)
    prompts, params = random_requests(rng, 10, tiny.config.vocab_size)
    engine = StaticBatchEngine(tiny, max_batch=4, block_size=4)
    outs = engine.generate(prompts, params)
    for p, sp, out in zip(prompts, params, outs):
        assert out.token_ids == solo(tiny, p, sp)
    # batches of 4: a batch runs as long as its longest request
    lengths = [len(o.token_ids) for o in outs]
    assert len(engine.step_log) == sum(max(lengths[i:i + 4]) for i in range(0, 10, 4))


def test_batching_loops_step_counts():
    out_lens = [1, 9, 2, 2, 8, 1, 1, 1]

    def make_step():
        left = {}

        def step(active):
            for r in active:
                left[r] = left.get(r, out_lens[r]) - 1
            return [left[r] == 0 for r in active]
        return step

    static = static_batching_loop(list(range(8)), 4, make_step())
    assert static == [4, 3, 1, 1, 1, 1, 1, 1, 1] + [4, 1, 1, 1, 1, 1, 1, 1]
    cont = continuous_batching_loop(list(range(8)), 4, make_step())
    assert len(cont) == 9 and sum(cont) == sum(out_lens)


def test_real_model_batched_equals_solo(real_model):
    torch.set_num_threads(2)
    model, tok = real_model
    questions = ["What is the capital of France?", "Name three colors."]
    # a 48-token budget splits the second prompt into two chunks, next to the first one's decodes
    llm = LLM.from_model(model, tok, num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=48)
    params = SamplingParams(max_tokens=8)
    outs = llm.generate(questions, params, chat=True)
    for q, out in zip(questions, outs):
        ids = tok.encode_chat([{"role": "user", "content": q}])
        assert out.token_ids == solo(model, ids, params, tok.stop_ids), q
    assert outs[0].text.startswith("The capital of France is Paris")
    assert llm.num_free_blocks() == 64


def test_serve_feeds_requests_at_their_arrival_times(tiny):
    from minillm.measure.workload import Request, serve

    rng = random.Random(5)
    reqs, t = [], 0.0
    for _ in range(6):
        t += rng.expovariate(50.0)
        reqs.append(Request([rng.randrange(256) for _ in range(rng.randint(1, 10))], rng.randint(1, 6), t))
    llm = LLM.from_model(tiny, num_blocks=40, block_size=4, max_num_seqs=3)
    outs, wall = serve(llm, reqs)
    assert wall >= reqs[-1].arrival_time
    for r, o in zip(reqs, outs):
        assert o.token_ids == solo(tiny, r.prompt_ids, r.params())
        assert o.metrics["ttft"] >= 0
