"""Fusion and compiled decoding (lesson 06): same outputs as the unfused, eager model, with fewer ops per step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minillm
from minillm.compile.torch_compile import StaticKVCache, static_length
from minillm.compile.fusion import (
    FusedGateUpMLP,
    FusedNormBlock,
    FusedQKVAttention,
    add_rms_norm,
    count_ops,
    fuse,
    fuse_gate_up,
    fuse_norms,
    fuse_qkv,
    split_qkv,
)
from minillm.kv_cache import KVCache
from minillm.model import model_bytes, rms_norm
from tests.conftest import tiny_model


@settings(max_examples=10, deadline=None)
@given(kv_heads=st.sampled_from([1, 2, 4]), which=st.sampled_from(["qkv", "gate_up", "norms", "all"]),
       seq=st.integers(1, 20), seed=st.integers(0, 100))
def test_each_fusion_keeps_the_logits(kv_heads, which, seq, seed):
    """GQA split sizes (q: n_heads x d, k and v: n_kv_heads x d) and concatenation order are what a wrong fusion
    gets wrong: MHA, GQA and MQA shapes all give the unfused logits."""
    model = tiny_model(seed, n_kv_heads=kv_heads)
    ids = torch.randint(0, 512, (2, seq), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        before = model(ids)
        {"qkv": fuse_qkv, "gate_up": fuse_gate_up, "norms": fuse_norms, "all": fuse}[which](model)
        torch.testing.assert_close(model(ids), before, atol=1e-5, rtol=1e-5)


def test_fused_weights_are_moved_not_copied():
    model = tiny_model(1)
    n_bytes, n_params = model_bytes(model), sum(p.numel() for p in model.parameters())
    wq = model.layers[0].attn.wq.weight.clone()
    fuse(model)
    assert model_bytes(model) == n_bytes and sum(p.numel() for p in model.parameters()) == n_params
    attn = model.layers[0].attn
    assert isinstance(attn, FusedQKVAttention) and not hasattr(attn, "wq")
    assert torch.equal(attn.wqkv.weight[: wq.shape[0]], wq)  # q rows first, then k, then v
    assert isinstance(model.layers[0].mlp, FusedGateUpMLP) and isinstance(model.layers[0], FusedNormBlock)
    assert fuse(model) is model and isinstance(model.layers[0].attn, FusedQKVAttention)  # idempotent


def test_split_qkv_sizes_follow_gqa():
    q, k, v = split_qkv(torch.zeros(3, (9 + 2 * 3) * 64), 9, 3, 64)
    assert q.shape == (3, 576) and k.shape == v.shape == (3, 192)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_equals_add_then_norm(dtype):
    g = torch.Generator().manual_seed(0)
    x, r, w = (torch.randn(4, 7, 64, generator=g).to(dtype) * 30 for _ in range(3))
    normed, h = add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(normed, rms_norm(x + r, w, 1e-5))


def test_fusion_removes_ops_from_a_decode_step():
    model = tiny_model(2, n_layers=4)
    ids = torch.randint(0, 512, (1, 8))
    cache = KVCache.for_model(model, 1, 16)
    with torch.inference_mode():
        model(ids, kv_cache=cache)
    eager = count_ops(model, ids[:, :1], kv_cache=cache)
    cache.truncate(8)
    fuse(model)
    fused = count_ops(model, ids[:, :1], kv_cache=cache)
    assert fused < eager - 4 * 4  # at least 4 fewer ops per block (2 matmuls, a RoPE, an add)


def test_static_cache_equals_contiguous_cache():
    """StaticKVCache attends over its whole buffer with a mask: same logits as reading the filled prefix."""
    model = tiny_model(3)
    ids = torch.randint(0, 512, (2, 14), generator=torch.Generator().manual_seed(1))
    static, contiguous = StaticKVCache.for_model(model, 2, 32), KVCache.for_model(model, 2, 14)
    with torch.inference_mode():
        outs = []
        for cache in (static, contiguous):
            steps = [model(ids[:, :9], kv_cache=cache)]
            for t in range(9, 14):  # explicit tensor positions: the compiled path's calling convention
                steps.append(model(ids[:, t:t + 1], positions=torch.tensor([t]), kv_cache=cache))
                if cache is static:
                    cache.seq_len += 1
            outs.append(torch.cat(steps, dim=1))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    assert static_length(14) == 256 and static_length(300) == 512


def test_compiled_decode_matches_eager_and_never_recompiles():
    """One compile, then 128 decode steps with zero recompiles (dynamo's counters); tokens identical to eager."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps the counters: an earlier compile in this process would count
    model = tiny_model(4, n_layers=2)
    prompt = list(range(5, 17))
    eager = minillm.generate(model, None, prompt, max_new_tokens=128, ignore_eos=True)
    compiled = minillm.generate(model, None, prompt, max_new_tokens=8, ignore_eos=True, compile=True)  # warm-up
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = minillm.generate(model, None, prompt, max_new_tokens=128, ignore_eos=True, compile=True)
    assert compiled.token_ids == eager.token_ids
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    with pytest.raises(ValueError, match="static contiguous cache"):
        minillm.generate(model, None, prompt, max_new_tokens=2, compile=True, cache="paged")
    torch._dynamo.reset()


def test_compile_without_a_compiler_says_why(monkeypatch):
    import minillm.compile.torch_compile as mc

    monkeypatch.setattr(mc.shutil, "which", lambda name: None)
    model = tiny_model(5)
    with pytest.raises(RuntimeError, match="C\\+\\+ compiler"):
        minillm.generate(model, None, [1, 2, 3], max_new_tokens=2, compile=True)


def test_fused_real_model_same_greedy_tokens(real_model):
    import copy

    model, tok = real_model
    fused = fuse(copy.deepcopy(model))
    ids = tok.encode("The capital of France is Paris. The capital of Italy is")
    a = minillm.generate(model, tok, ids, max_new_tokens=24, ignore_eos=True)
    b = minillm.generate(fused, tok, ids, max_new_tokens=24, ignore_eos=True)
    assert a.token_ids == b.token_ids
    x = torch.tensor([ids])
    with torch.inference_mode():
        assert (fused(x) - model(x)).abs().max() <= 1e-4


def test_engine_on_a_fused_model_gives_the_same_outputs():
    """The engine's packed, paged forward runs the fused blocks unchanged (LLM(..., fuse=True) /
    load_model(fuse=True))."""
    model = tiny_model(6)
    prompts = [[3, 5, 7, 9, 11], list(range(20, 41)), [2, 4]]
    params = minillm.SamplingParams(max_tokens=9)
    plain = minillm.LLM.from_model(model, None, num_blocks=32, block_size=4).generate(prompts, params)
    fused = minillm.LLM.from_model(fuse(model), None, num_blocks=32, block_size=4).generate(prompts, params)
    assert [o.token_ids for o in fused] == [o.token_ids for o in plain]


def test_a_copy_of_a_compiled_model_compiles_its_own_forward():
    import copy

    from minillm.compile.torch_compile import compiled_decode

    model = tiny_model(7, n_layers=1)
    step = compiled_decode(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.layers[0].mlp.down.weight.mul_(2)  # the copy must run its own weights, not the original's
    assert compiled_decode(twin) is not step and compiled_decode(model) is step
