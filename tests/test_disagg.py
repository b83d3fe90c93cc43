"""Disaggregated prefill/decode (lesson 13): the oracle is the colocated engine, one minillm.LLM, token for token.

Three layers: kv_transfer's pack/unpack (pure tensors), the engine seam (add_prefill on one LLM, add_prefilled on
another, no processes) and DisaggregatedLLM (two spawned workers, KV over gloo)."""

from __future__ import annotations

import functools
import time

import pytest
import torch
from tests.conftest import tiny_model
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from minillm.cache import kv_transfer
from minillm.engine import LLM
from minillm.cache.kv_pool import KVBlockPool, KVCacheSpec
from minillm.cache.kv_transfer import kv_checksum, pack_kv_blocks, stored_tensors, unpack_kv_blocks
from minillm.engine.output import StreamEvent
from minillm.gguf.loader import load_spec
from minillm.request import RequestOutput
from minillm.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = {"tiny": {}, "seed": 3}  # what the workers rebuild; load_spec(SPEC) here is the same model
GREEDY = SamplingParams(max_tokens=7, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=7, temperature=1.0, top_k=50, seed=11, ignore_eos=True)


def ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def colocated(model, prompts, params, **kw):
    return [o.token_ids for o in LLM.from_model(model, num_blocks=64, **kw).generate(prompts, params)]


def prefill_then_decode(model, prompt, params, pkw=None, dkw=None):
    src = LLM.from_model(model, num_blocks=64, **(pkw or {}))
    dst = LLM.from_model(model, num_blocks=64, **(dkw or {}))
    src.add_prefill(prompt, params)
    while src.has_unfinished():
        src.step()
    (h,) = src.pop_handoffs()
    assert src.num_free_blocks() == 64 and not src._finished  # nothing left behind on the prefill side
    rid = dst.add_prefilled(h)
    while dst.has_unfinished():
        dst.step()
    assert dst.num_free_blocks() == 64
    return dst.pop_output(rid).token_ids, h


# ---------------------------------------------------------------------------------------------- pack / unpack


@given(n_tokens=st.integers(1, 40), block_size=st.sampled_from([1, 4, 16]), int8=st.booleans())
@hsettings(max_examples=25)
def test_pack_unpack_moves_exactly_the_sequences_blocks(n_tokens, block_size, int8):
    spec = KVCacheSpec(2, 2, 8, 12 * 16 // block_size, block_size, kv_dtype=torch.int8 if int8 else None)
    src, dst = KVBlockPool(spec), KVBlockPool(spec)
    for t in stored_tensors(src).values():
        t.copy_(torch.randint(-100, 100, t.shape).to(t.dtype))
    n_blocks = -(-n_tokens // block_size)
    table = list(range(spec.num_blocks))[::-1][:n_blocks]  # scattered, reversed
    payload = pack_kv_blocks(src, table, n_tokens)
    assert payload["k"].shape == (2, n_blocks, block_size, 2, 8) and set(payload) == set(stored_tensors(src))
    other = list(range(n_blocks))
    unpack_kv_blocks(dst, other, payload)
    for name, t in stored_tensors(dst).items():
        assert torch.equal(t[:, other], stored_tensors(src)[name][:, table])
    assert kv_checksum(pack_kv_blocks(dst, other, n_tokens)) == kv_checksum(payload)
    with pytest.raises(ValueError, match="block size, heads and layers"):
        unpack_kv_blocks(dst, other + [spec.num_blocks - 1], payload)


def test_pack_unpack_refuse_what_does_not_fit():
    spec = KVCacheSpec(2, 2, 8, 8, 4)
    pool = KVBlockPool(spec)
    with pytest.raises(ValueError, match="cannot pack 9 tokens from 2 blocks"):
        pack_kv_blocks(pool, [0, 1], 9)
    payload = pack_kv_blocks(pool, [0, 1], 8)
    with pytest.raises(ValueError, match="same kv_cache_dtype"):
        unpack_kv_blocks(KVBlockPool(KVCacheSpec(2, 2, 8, 8, 4, kv_dtype=torch.int8)), [2, 3], payload)
    with pytest.raises(ValueError, match="same kv_cache_dtype"):
        unpack_kv_blocks(KVBlockPool(KVCacheSpec(2, 2, 8, 8, 4, kv_dtype=torch.bfloat16)), [2, 3], payload)
    with pytest.raises(ValueError, match="block size, heads and layers"):
        unpack_kv_blocks(KVBlockPool(KVCacheSpec(3, 2, 8, 8, 4)), [2, 3], payload)
    with pytest.raises(ValueError, match="block size, heads and layers"):
        unpack_kv_blocks(KVBlockPool(KVCacheSpec(2, 2, 8, 8, 8)), [2, 3], payload)
    changed = {**payload, "v": payload["v"].clone()}
    changed["v"][0, 0, 0, 0, 0] += 1
    assert kv_checksum(changed) != kv_checksum(payload)


# ------------------------------------------------------------------------------------------- the engine seam


@given(n=st.integers(1, 37), block_size=st.sampled_from([1, 4, 16]), budget=st.sampled_from([8, 512]),
       seeded=st.booleans(), int8=st.booleans())
@hsettings(max_examples=20)
def test_seam_equals_one_engine(n, block_size, budget, seeded, int8):
    """Prefill on one engine (chunked when the budget is small, prefix caching on), decode on another = one
    engine. Seeded sampling continues from the carried generator state."""
    model = tiny_model(3)
    params = SEEDED if seeded else GREEDY
    kv = "int8" if int8 else None
    want = colocated(model, [ids(n, n)], params, block_size=block_size, kv_cache_dtype=kv)[0]
    got, h = prefill_then_decode(model, ids(n, n), params, dict(block_size=block_size, kv_cache_dtype=kv,
                                                                max_num_batched_tokens=budget,
                                                                enable_prefix_caching=True),
                                 dict(block_size=block_size, kv_cache_dtype=kv))
    assert got == want
    assert h.params is params and h.nbytes == sum(t.numel() * t.element_size() for t in h.payload.values())
    assert h.checksum == kv_checksum(h.payload) and h.num_computed_tokens == n


def test_a_first_token_that_ends_the_request_needs_no_decode_blocks():
    model = tiny_model(3)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    got, h = prefill_then_decode(model, ids(9), one)
    assert h.finish_reason == "length" and got == colocated(model, [ids(9)], one)[0]


def test_a_fault_while_writing_the_kv_gives_the_blocks_back(monkeypatch):
    model = tiny_model(3)
    src, dst = LLM.from_model(model, num_blocks=64), LLM.from_model(model, num_blocks=64)
    src.add_prefill(ids(30), GREEDY)
    while src.has_unfinished():
        src.step()
    (h,) = src.pop_handoffs()

    def broken(pool, table, payload):
        unpack_kv_blocks(pool, table[:1], {k: t[:, :1] for k, t in payload.items()})  # half written
        raise RuntimeError("injected")

    monkeypatch.setattr(kv_transfer, "unpack_kv_blocks", broken)
    with pytest.raises(RuntimeError, match="injected"):
        dst.add_prefilled(h)
    assert dst.num_free_blocks() == 64 and not dst.has_unfinished()
    monkeypatch.undo()
    rid = dst.add_prefilled(h)  # the same handoff goes through once the fault is gone
    while dst.has_unfinished():
        dst.step()
    assert dst.pop_output(rid).token_ids == colocated(model, [ids(30)], GREEDY)[0]


def test_add_prefilled_refuses_what_does_not_fit():
    model = tiny_model(3)
    src = LLM.from_model(model, num_blocks=64, block_size=4)
    src.add_prefill(ids(30), GREEDY, request_id="moved")
    while src.has_unfinished():
        src.step()
    (h,) = src.pop_handoffs()
    with pytest.raises(ValueError, match="same block_size"):
        LLM.from_model(model, num_blocks=64, block_size=8).add_prefilled(h)
    with pytest.raises(ValueError, match="same kv_cache_dtype"):
        LLM.from_model(model, num_blocks=64, block_size=4, kv_cache_dtype="int8").add_prefilled(h)
    with pytest.raises(ValueError, match="layers must match"):
        LLM.from_model(tiny_model(3, n_layers=3), num_blocks=64, block_size=4).add_prefilled(h)
    with pytest.raises(TypeError, match="KVHandoff"):
        LLM.from_model(model, num_blocks=64, block_size=4).add_prefilled({"k": 1})
    bad = kv_transfer.KVHandoff(**{**h.__dict__, "payload": {k: t.clone() for k, t in h.payload.items()}})
    bad.payload["k"].view(-1)[0] += 1
    with pytest.raises(ValueError, match="corrupted in transfer"):
        LLM.from_model(model, num_blocks=64, block_size=4).add_prefilled(bad)
    full = LLM.from_model(model, num_blocks=10, block_size=4)  # 30 + 1 tokens need 8 blocks
    full.add_request(ids(9, 1), SamplingParams(max_tokens=2, ignore_eos=True))
    full.step()  # another request holds 3 blocks now
    assert not full.can_add_prefilled(h)
    with pytest.raises(RuntimeError, match="retry after a step"):
        full.add_prefilled(h)
    assert full.num_free_blocks() == 7
    while full.has_unfinished():
        full.step()
    assert full.can_add_prefilled(h)
    full.add_prefilled(h)


# ---------------------------------------------------------------------------------------- the two processes

# the same random model speaking SmolLM2's vocabulary: text and chat prompts without loading the real weights
TEXT_SPEC = {**SPEC, "tokenizer": "smollm2-135m"}


@functools.cache
def text_model():
    return load_spec(TEXT_SPEC)  # (model, tokenizer), loaded once for the module


def wait_for(cond, d, timeout_s: float = 20.0) -> None:
    deadline = time.perf_counter() + timeout_s
    while not cond():
        assert time.perf_counter() < deadline, "timed out"
        d._pump(0.05)


@pytest.fixture(scope="module")
def disagg():
    from minillm.cluster.disagg import DisaggregatedLLM

    with DisaggregatedLLM(TEXT_SPEC, prefill=dict(block_size=4, num_blocks=64, max_num_batched_tokens=8,
                                                  enable_prefix_caching=True),
                          decode=dict(block_size=4, num_blocks=64), timeout_s=60) as d:
        yield d
    assert not any(p.is_alive() for p in d.processes.values())


LENGTHS = (1, 3, 4, 5, 8, 16, 17, 33)


def test_disaggregated_greedy_and_seeded_equal_colocated(disagg):
    model = text_model()[0]
    prompts = [ids(n, n) for n in LENGTHS] + [ids(8, 8) + [7, 7]]  # the last shares a cached prefix
    for params in (GREEDY, SEEDED):
        outs = disagg.generate(prompts, params)
        assert [o.token_ids for o in outs] == colocated(model, prompts, params, block_size=4)
        assert all(o.finish_reason == "length" and o.metrics["ttft"] > 0 for o in outs)
    # the KV bytes moved: 2 (K and V) x layers x kv_heads x head_dim x 4 bytes per token, whole blocks
    cfg = model.config
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4
    stats = disagg.stats()["requests"][-len(prompts):]
    assert [s["transfer_bytes"] for s in stats] == [per_token * 4 * -(-len(p) // 4) for p in prompts]
    assert all(0 < s["transfer_s"] < s["ttft_s"] for s in stats)
    wait_for(lambda: disagg.decode_free_blocks == 64, disagg)
    one = disagg.generate([ids(6)], SamplingParams(max_tokens=1, ignore_eos=True))[0]  # ends on the prefill side
    assert one.token_ids == colocated(model, [ids(6)], SamplingParams(max_tokens=1))[0]


TEXTS = ["The capital of France is", "Write a haiku about caches.", "def fibonacci(n):"]
PER_PROMPT = [SamplingParams(max_tokens=6, ignore_eos=True), SamplingParams(max_tokens=3, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.8, seed=5, ignore_eos=True)]


@pytest.mark.parametrize("chat", [False, True])
def test_text_prompts_and_per_prompt_params_give_llms_outputs(disagg, chat):
    model, tok = text_model()
    want = LLM.from_model(model, tok, num_blocks=64, block_size=4).generate(TEXTS, PER_PROMPT, chat=chat)
    got = disagg.generate(TEXTS, PER_PROMPT, chat=chat)
    assert all(type(o) is RequestOutput for o in got)
    assert [o.prompt_token_ids for o in got] == [o.prompt_token_ids for o in want]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    assert [len(o.token_ids) for o in got] == [p.max_tokens for p in PER_PROMPT]


def test_stream_yields_llms_stream_events(disagg):
    model, tok = text_model()
    want = {}
    for ev in LLM.from_model(model, tok, num_blocks=64, block_size=4).stream(TEXTS, PER_PROMPT, chat=True):
        want.setdefault(TEXTS[int(ev.request_id)], []).append(ev[1:])  # (token, text, finished, reason)
    events = list(disagg.stream(TEXTS, PER_PROMPT, chat=True))
    assert all(type(ev) is StreamEvent for ev in events)
    rids = list(dict.fromkeys(ev.request_id for ev in events))
    got = {text: [ev[1:] for ev in events if ev.request_id == rid] for text, rid in zip(TEXTS, rids)}
    assert got == want  # every token, its text piece and the one finishing event, per request
    assert len(rids) == 3 and not disagg._reqs  # all ended and collected


def test_disaggregated_refuses_bad_requests_and_keeps_serving(disagg):
    too_long = SamplingParams(max_tokens=600, ignore_eos=True)  # the tiny context is 512
    with pytest.raises(RuntimeError, match=r"1 of 1 requests failed; request \d+: refused: .*context window"):
        disagg.generate([ids(5)], too_long)
    with pytest.raises(TypeError, match="SamplingParams"):
        disagg.submit(ids(5), {"max_tokens": 3})
    with pytest.raises(ValueError, match="request 1: the prompt is empty"):  # checked before any is sent
        disagg.generate([ids(5), "  "], GREEDY)
    with pytest.raises(TypeError, match="list of prompts"):
        disagg.generate("a bare prompt", GREEDY)
    assert len(disagg.generate([ids(5)], GREEDY)[0].token_ids) == 7


def test_a_killed_prefill_worker_fails_only_the_requests_it_still_held():
    """The prefill worker hands two requests over, then holds the rest (a fault: it stops stepping) and is killed.
    The two already decoding finish with LLM's answer; the three it held end with an error naming its death."""
    from minillm.cluster.disagg import DisaggregatedLLM

    prompts = [ids(12, i) for i in range(5)]
    params = [SamplingParams(max_tokens=80, ignore_eos=True)] * 2 + [GREEDY] * 3
    want = colocated(load_spec(SPEC)[0], prompts, params, block_size=4)
    # one sequence per prefill step: exactly the first two requests are handed off before the hold
    with DisaggregatedLLM(SPEC, prefill=dict(block_size=4, max_num_seqs=1), decode=dict(block_size=4),
                          timeout_s=60, _fault=("hold", 2)) as d:
        rids = [d.submit(p, sp) for p, sp in zip(prompts, params)]
        moved, held = rids[:2], rids[2:]
        wait_for(lambda: all(d._reqs[r].token_ids for r in moved), d)  # decoding on the decode worker
        assert not any(d._reqs[r].on_decode for r in held)
        assert not all(d._reqs[r].done for r in moved)  # mid-answer (80 tokens) when the prefill worker dies
        d.processes["prefill"].kill()
        outs = [d.result(r) for r in rids]
        assert [o.token_ids for o in outs[:2]] == want[:2]
        assert all(o.finish_reason == "length" and o.metrics["error"] is None for o in outs[:2])
        for o in outs[2:]:
            assert o.finish_reason == "error" and o.token_ids == []
            assert "prefill worker died (exit code -9)" in o.metrics["error"], o.metrics["error"]
        assert d.processes["decode"].is_alive()
        with pytest.raises(RuntimeError, match="no prefill worker alive"):
            d.submit(ids(5), GREEDY)


def test_int8_kv_and_a_corrupted_transfer():
    """int8 KV moves with its scales; a payload corrupted on the way is refused (checksum) without holding blocks,
    and the next request is served."""
    from minillm.cluster.disagg import DisaggregatedLLM

    model = load_spec(SPEC)[0]
    kw = dict(block_size=4, num_blocks=64, kv_cache_dtype="int8")
    with DisaggregatedLLM(SPEC, prefill=kw, decode=kw, timeout_s=60, _fault=("corrupt", 1)) as d:
        first = d.generate([ids(13)], GREEDY)[0]
        assert first.token_ids == colocated(model, [ids(13)], GREEDY, block_size=4, kv_cache_dtype="int8")[0]
        bad = d.generate([ids(14)], GREEDY, raise_on_error=False)[0]
        assert bad.finish_reason == "error" and "corrupted in transfer" in bad.metrics["error"]
        assert d.decode_free_blocks == 64
        assert len(d.generate([ids(15)], GREEDY)[0].token_ids) == 7


def test_a_killed_decode_worker_ends_its_requests_with_an_error():
    from minillm.cluster.disagg import DisaggregatedLLM

    with DisaggregatedLLM(SPEC, prefill=dict(block_size=4), decode=dict(block_size=4), timeout_s=60) as d:
        rids = [d.submit(ids(20, i), SamplingParams(max_tokens=400, ignore_eos=True)) for i in range(3)]
        wait_for(lambda: all(d._reqs[r].token_ids for r in rids), d)  # decoding
        d.processes["decode"].kill()
        t0 = time.perf_counter()
        outs = [d.result(r) for r in rids]
        assert time.perf_counter() - t0 < 10
        assert all(o.finish_reason == "error" and "decode worker died (exit code -9)" in o.metrics["error"]
                   for o in outs)
        with pytest.raises(RuntimeError, match="no decode worker alive"):
            d.submit(ids(5), GREEDY)


def test_workers_with_different_weights_or_layouts_are_refused():
    from minillm.cluster.disagg import DisaggregatedLLM

    with pytest.raises(ValueError, match="same block_size"):
        DisaggregatedLLM(SPEC, prefill=dict(block_size=4), decode=dict(block_size=8))
    with pytest.raises(ValueError, match="same kv_cache_dtype"):
        DisaggregatedLLM(SPEC, prefill=dict(kv_cache_dtype="int8"))
    with pytest.raises(TypeError, match="unknown"):
        DisaggregatedLLM(SPEC, decode=dict(blocksize=4))
    with pytest.raises(RuntimeError, match="different weights"):
        DisaggregatedLLM(SPEC, decode_model={"tiny": {}, "seed": 4}, timeout_s=60)


@pytest.mark.slow
def test_a_prefill_worker_dying_mid_transfer_is_an_error_not_a_hang():
    from minillm.cluster.disagg import DisaggregatedLLM

    with DisaggregatedLLM(SPEC, timeout_s=60, _fault=("die_mid_transfer", 0)) as d:
        out = d.generate([ids(10)], GREEDY, raise_on_error=False)[0]
        assert out.finish_reason == "error" and "prefill worker died (exit code 3)" in out.metrics["error"]


@pytest.mark.slow
def test_real_model_disaggregated_equals_colocated(real_model):
    from minillm.cluster.disagg import DisaggregatedLLM

    model, tok = real_model
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, " * 6]
    params = SamplingParams(max_tokens=12)
    want = [o.token_ids for o in LLM.from_model(model, tok, num_blocks=64).generate(prompts, params)]
    with DisaggregatedLLM("smollm2-135m", prefill=dict(num_blocks=64, max_num_batched_tokens=16),
                          decode=dict(num_blocks=64), timeout_s=120) as d:
        outs = d.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert "Paris" in outs[0].text
