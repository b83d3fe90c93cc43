"""LLM-Pruner's and LoRAPrune's importance (compress/llm_pruner.py). Oracles: the loss itself (scaling a group of
weights by 1 - eps changes it by eps * sum w * dL/dw, checked by finite differences in float64), group index sets
built by plain loops over heads and channels, and LoRA's gradient projection equal to the weight's gradient when the
adapter spans every input direction."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.compress.llm_pruner import lora_gradients, taylor_importance, weight_gradients
from minillm.compress.lora import add_lora
from minillm.compress.pruning import prune_ffn_channels, prune_kv_groups
from tests.conftest import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
IDS = list(range(3, 131))  # 128 calibration tokens: two windows of 64


def group_entries(model, i: int, group: int) -> list[tuple[str, tuple]]:
    """(matrix, index) of every weight of block i's KV group `group`, by loops over its heads."""
    cfg, out = model.config, []
    hd, g = cfg.head_dim, cfg.group_size
    for h in range(cfg.n_heads):
        if h // g == group:
            out += [("wq", (slice(h * hd, (h + 1) * hd), slice(None))),
                    ("wo", (slice(None), slice(h * hd, (h + 1) * hd)))]
    out += [(n, (slice(group * hd, (group + 1) * hd), slice(None))) for n in ("wk", "wv")]
    return out


def channel_entries(c: int) -> list[tuple[str, tuple]]:
    return [("gate", (c, slice(None))), ("up", (c, slice(None))), ("down", (slice(None), c))]


def lin(model, i: int, name: str):
    b = model.layers[i]
    return getattr(b.attn if name in ("wq", "wk", "wv", "wo") else b.mlp, name)


@given(st.sampled_from([(4, 2), (4, 4), (6, 2), (4, 1)]), st.sampled_from(["vector", "element"]),
       st.integers(0, 3))
@settings(max_examples=8)
def test_importance_equals_a_loop_over_each_groups_weights(heads, rule, seed):
    n_heads, n_kv = heads
    model = tiny_model(seed, n_heads=n_heads, n_kv_heads=n_kv, dim=16 * n_heads).double()
    grads = weight_gradients(model, IDS, window=64)
    kv, ffn = taylor_importance(model, grads, rule)
    for i in range(len(model.layers)):
        for grp in range(n_kv):
            prods = [(lin(model, i, n).weight.detach()[ix] * grads[f"{i}.{'attn'}.{n}"][ix]).flatten()
                     for n, ix in group_entries(model, i, grp)]
            want = torch.cat(prods).sum().abs() if rule == "vector" else torch.cat(prods).abs().sum()
            torch.testing.assert_close(kv[i, grp].double(), want.float().double(), rtol=1e-4, atol=1e-9)
        for c in (0, model.config.ffn_dim - 1):
            prods = [(lin(model, i, n).weight.detach()[ix] * grads[f"{i}.mlp.{n}"][ix]).flatten()
                     for n, ix in channel_entries(c)]
            want = torch.cat(prods).sum().abs() if rule == "vector" else torch.cat(prods).abs().sum()
            torch.testing.assert_close(ffn[i, c].double(), want.float().double(), rtol=1e-4, atol=1e-9)


def test_the_vector_rule_is_the_loss_change_of_shrinking_the_group():
    """(L(group scaled by 1 + eps) - L(group scaled by 1 - eps)) / 2 eps = sum w * g + O(eps^2): the first-order
    estimate, for every KV group and a few channels (central differences: parts of the forward, RMSNorm and
    softmax, run in float32 even for a float64 model, so a one-sided difference at a tiny eps is mostly noise)."""
    from minillm.compress.llm_pruner import _loss

    model = tiny_model(1).double()
    grads = weight_gradients(model, IDS, window=64)
    kv, ffn = taylor_importance(model, grads, "vector")
    eps = 1e-3
    with torch.no_grad():
        def scaled(entries, i, factor: float) -> float:
            saved = [(lin(model, i, n).weight, ix, lin(model, i, n).weight[ix].clone()) for n, ix in entries]
            for w, ix, v in saved:
                w[ix] = v * factor
            loss = _loss(model, IDS, 64).item()
            for w, ix, v in saved:
                w[ix] = v
            return loss

        def slope(entries, i) -> float:
            return abs(scaled(entries, i, 1 + eps) - scaled(entries, i, 1 - eps)) / (2 * eps)

        for i in range(2):
            for grp in range(model.config.n_kv_heads):
                assert slope(group_entries(model, i, grp), i) == pytest.approx(float(kv[i, grp]), rel=0.02, abs=1e-3)
            for c in (0, 7, 100):
                assert slope(channel_entries(c), i) == pytest.approx(float(ffn[i, c]), rel=0.02, abs=1e-3)


def test_lora_gradients_equal_the_weights_when_the_adapter_spans_every_input():
    """With B = 0 the adapters' gradients give G A^T A / ... = G A^T A (dL/dA = 0); an orthogonal square A makes
    that G itself: LoRAPrune's estimate is exact, and it is a projection otherwise."""
    model = tiny_model(2).double()
    want = weight_gradients(model, IDS, window=64)
    add_lora(model, rank=64, alpha=64.0)  # dim 64: every matmul's input is 64 wide except down's (128)
    for name, m in model.named_modules():
        if hasattr(m, "A"):
            q, _ = torch.linalg.qr(torch.randn(m.A.shape[1], m.A.shape[1], dtype=torch.float64))
            m.A.data = q[:m.A.shape[0]].clone()  # orthonormal rows
    got = lora_gradients(model, IDS, window=64)
    for key, g in want.items():
        if key.endswith("down"):  # rank 64 of 128 inputs: a projection, never larger than the gradient
            assert got[key].norm() <= g.norm() * (1 + 1e-9)
        else:
            torch.testing.assert_close(got[key].double(), g.double(), rtol=1e-6, atol=1e-10)


def test_pruning_by_taylor_importance_keeps_the_most_important_and_runs():
    model = tiny_model(3)
    kv, ffn = taylor_importance(model, weight_gradients(model, IDS, window=64), "element")
    prune_kv_groups(model, 1, kv)
    prune_ffn_channels(model, 32, ffn)
    assert model.config.n_kv_heads == 1 and model.config.ffn_dim == 32
    assert torch.isfinite(model(torch.tensor([IDS[:16]]))).all()


def test_keeping_every_group_changes_nothing():
    model = tiny_model(4)
    x = torch.tensor([IDS[:20]])
    before = model(x)
    kv, ffn = taylor_importance(model, weight_gradients(model, IDS, window=64))
    prune_kv_groups(model, model.config.n_kv_heads, kv)
    prune_ffn_channels(model, model.config.ffn_dim, ffn)
    torch.testing.assert_close(model(x), before)


def test_requires_grad_flags_are_restored_and_bad_input_is_refused():
    model = tiny_model(5)
    model.requires_grad_(False)
    grads = weight_gradients(model, IDS, window=64)
    assert not any(p.requires_grad for p in model.parameters())
    with pytest.raises(ValueError, match="rule must be one of"):
        taylor_importance(model, grads, "magnitude")
    with pytest.raises(ValueError, match="another model"):
        taylor_importance(tiny_model(0, ffn_dim=96), grads)
    with pytest.raises(ValueError, match="add LoRA first"):
        lora_gradients(model, IDS, window=64)
