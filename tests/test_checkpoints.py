"""minillm.course.seams: the learner's exercise code swapped into the model, the caches and the engine, and back out.

The real-model tasks of the graders (task_NN_real_model) rely on this; here a tiny random model keeps it fast.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import minillm.attention
import minillm.cache.paged
import minillm.cache.paged_attention
import minillm.decode_loop
import minillm.engine.llm
import minillm.engine.scheduler
import minillm.kv_cache
import minillm.model
from minillm.course.seams import STANDS_ON, check_on_ladder, implemented, pieces, use_exercises
from minillm.kv_cache import KVCache
from tests.conftest import tiny_model

sol = {k: importlib.import_module(f"solutions.{k}") for k in STANDS_ON}


def _originals():
    return (minillm.model.rms_norm, minillm.model.apply_rope, minillm.decode_loop.sample_from_logits,
            minillm.kv_cache.append_kv, minillm.kv_cache.KVCache,
            minillm.cache.paged.BlockAllocator, minillm.engine.llm.BlockAllocator,
            minillm.cache.paged_attention.slot_mapping, minillm.cache.paged_attention.context_slots,
            minillm.cache.paged.PagedKVCache.__init__, minillm.engine.scheduler.schedule_step,
            minillm.engine.scheduler.postprocess_step, set(minillm.attention._REGISTRY))


def test_stubs_are_told_from_written_pieces():
    stubs = importlib.import_module("exercises.ex00_decoder")
    assert not implemented(stubs.rms_norm) and implemented(sol["ex00_decoder"].rms_norm)
    assert not implemented(importlib.import_module("exercises.ex04_paged").BlockAllocator)  # some methods are stubs
    assert implemented(sol["ex04_paged"].BlockAllocator)
    assert pieces(stubs, skip_stubs=True) == [] and pieces(stubs) == ["rms_norm", "apply_rope", "naive_attention",
                                                                        "sample_from_logits"]


def test_everything_is_swapped_in_and_restored():
    model = tiny_model()
    before = _originals()
    with use_exercises(model, *sol.values()) as used:
        assert len(used) == sum(len(pieces(m)) for m in sol.values())
        assert minillm.model.rms_norm is sol["ex00_decoder"].rms_norm
        assert minillm.cache.paged.BlockAllocator is sol["ex04_paged"].BlockAllocator
        assert minillm.engine.scheduler.schedule_step is sol["ex05_batching"].schedule_step
        assert model.attn_backend == "exercise_ex03_flash"  # the last dense attention wins
        assert issubclass(minillm.kv_cache.KVCache, KVCache) and minillm.kv_cache.KVCache is not KVCache
        assert minillm.cache.paged_attention.slot_mapping is sol["ex04_paged"].slot_mapping  # what build and
        assert minillm.cache.paged_attention.context_slots is sol["ex04_paged"].context_slots  # StepPlan.build call
        cache = minillm.cache.paged.PagedSequenceCache.for_model(model, 1, 8)
        assert isinstance(cache.allocator, sol["ex04_paged"].BlockAllocator)
        llm = minillm.engine.llm.LLM.from_model(model, num_blocks=4)  # the engine's own allocator, shared
        assert isinstance(llm.cache.allocator, sol["ex04_paged"].BlockAllocator)
        assert llm.block_manager.allocator is llm.cache.allocator
    assert _originals() == before and model.attn_backend == "sdpa"


def test_a_failure_on_the_ladder_names_the_earlier_exercise(monkeypatch):
    model = tiny_model()
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = model(ids)

    def check():
        cache = minillm.kv_cache.KVCache.for_model(model, 1, 9)
        with torch.inference_mode():
            got = torch.cat([model(ids[:, :8], kv_cache=cache), model(ids[:, 8:], kv_cache=cache)], dim=1)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    assert "ex00_decoder.rms_norm" in check_on_ladder(model, sol["ex01_kv_cache"], check)  # right on the right ladder
    ex00 = sol["ex00_decoder"]
    monkeypatch.setattr(ex00, "rms_norm", lambda x, weight, eps: x * weight)  # a written, wrong exercise 00
    with pytest.raises(AssertionError, match="minillm grade 00"):
        check_on_ladder(model, sol["ex01_kv_cache"], check)
    monkeypatch.setattr(sol["ex01_kv_cache"], "decode_attention", lambda q, k, v, n: q * 0)  # now 01 is wrong too
    with pytest.raises(AssertionError) as info:
        check_on_ladder(model, sol["ex01_kv_cache"], check)
    assert "minillm grade 00" not in str(info.value)  # its own failure, not the earlier exercise's



def test_the_learners_slots_serve_the_paged_cache():
    """Exercise 04's slot_mapping and context_slots are what the paged cache writes and reads through: the learner's
    functions are called and give the model's logits; a wrong slot_mapping changes them."""
    import types

    model = tiny_model()
    ids = torch.randint(0, model.config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = model(ids)

    def paged_logits():  # a prefill of 17 tokens over two blocks of 16, then four decode steps
        cache = minillm.cache.paged.PagedSequenceCache.for_model(model, 1, 21)
        with torch.inference_mode():
            return torch.cat([model(ids[:, :17], kv_cache=cache)] +
                             [model(ids[:, t:t + 1], kv_cache=cache) for t in range(17, 21)], dim=1)

    calls = {"slot_mapping": 0, "context_slots": 0}

    def counted(name, fn):
        def wrapper(*args):
            calls[name] += 1
            return fn(*args)
        return wrapper

    learner = types.ModuleType("learner.ex04_paged")
    learner.BlockAllocator = sol["ex04_paged"].BlockAllocator
    learner.slot_mapping = counted("slot_mapping", sol["ex04_paged"].slot_mapping)
    learner.context_slots = counted("context_slots", sol["ex04_paged"].context_slots)
    with use_exercises(model, learner):
        torch.testing.assert_close(paged_logits(), want, atol=1e-4, rtol=1e-4)
    assert calls == {"slot_mapping": 5, "context_slots": 4}  # one write per step; the prefill reads no old context
    learner.slot_mapping = lambda tables, lens, qlens, block_size: list(range(sum(qlens)))  # ignores the tables
    with use_exercises(model, learner):
        assert not torch.allclose(paged_logits()[:, 17:], want[:, 17:], atol=1e-3)
    assert minillm.cache.paged_attention.slot_mapping is not learner.slot_mapping
