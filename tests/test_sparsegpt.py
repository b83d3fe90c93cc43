"""SparseGPT (lesson 08): the blocked, lazy OBS update against an unblocked column-by-column reference and the exact
least-squares optimum, exact sparsity and 2:4 patterns over random shapes, bad input, and on a tiny model an output
error below Wanda's and magnitude's at 50%."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.compress.sparsegpt import (HessianAccumulator, prune_sparsegpt, reconstruction_error,
                                        sparsegpt_prune_weight)
from minillm.compress.sparsity import is_n_m_sparse, prune, semi_structured_mask, unstructured_mask, wanda_scores
from tests.conftest import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def problem(rows: int, cols: int, seed: int = 0, tokens: int | None = None):
    """A weight (rows, cols) and the mean x x^T of `tokens` random inputs (full rank when tokens >= cols), float64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens or 2 * cols + 8, cols, generator=g, dtype=torch.float64)
    mix = torch.randn(cols, cols, generator=g, dtype=torch.float64) / 2 / cols**0.5 + torch.eye(cols)
    x = x @ mix * torch.rand(cols, generator=g, dtype=torch.float64).add(0.2)  # correlated, of different loudness
    return torch.randn(rows, cols, generator=g, dtype=torch.float64), x.T @ x / x.shape[0]


def damped(h: torch.Tensor, damp: float) -> torch.Tensor:
    return h + damp * h.diagonal().mean() * torch.eye(h.shape[0], dtype=h.dtype)


def least_squares(w: torch.Tensor, h: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Oracle: per row, min ||(w' - w) X||^2 with w'[~keep] = 0. The kept weights K move by H_KK^-1 H_KP w_P."""
    out = torch.zeros_like(w)
    for r in range(w.shape[0]):
        k, p = keep[r], ~keep[r]
        out[r, k] = w[r, k] + torch.linalg.solve(h[k][:, k], h[k][:, p] @ w[r, p])
    return out


def column_by_column(w: torch.Tensor, h: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Reference: one column at a time, the explicit inverse of the Hessian of the columns still free (j..), and the
    OBS update of every free weight of each row whose column-j weight is pruned. No blocks, no Cholesky."""
    w = w.clone()
    for j in range(w.shape[1]):
        inv = torch.linalg.inv(h[j:, j:])
        pruned = ~keep[:, j]
        w[pruned, j:] -= (w[pruned, j] / inv[0, 0])[:, None] * inv[0][None, :]
    return w * keep


def out_err(w_new, w, h) -> float:
    return reconstruction_error(w, w_new, h)


# ------------------------------------------------------------------------------------------------ the oracles


def test_pruning_the_leading_columns_is_the_exact_least_squares_optimum():
    """Every pruned column left of every kept one (row r prunes its first k_r): the sequential update reaches the
    optimum, because each kept weight is still free when each pruned one is removed."""
    w, h = problem(5, 24, seed=1)
    k = torch.tensor([3, 12, 0, 20, 7])
    keep = torch.arange(24)[None, :] >= k[:, None]
    new, mask = sparsegpt_prune_weight(w.float(), h.float(), mask=keep, block=5, damp=0)
    assert torch.equal(mask, keep)
    want = least_squares(w, h, keep)
    torch.testing.assert_close(new.double(), want, atol=2e-4, rtol=1e-4)
    assert out_err(new.double(), w, h) < 0.9 * out_err(w * keep, w, h)  # and the repair is worth something


@pytest.mark.parametrize("block", [1, 3, 8, 24, 128])
def test_blocked_lazy_update_equals_the_column_by_column_reference(block):
    w, h = problem(6, 24, seed=2)
    keep = torch.rand(6, 24, generator=torch.Generator().manual_seed(3)) > 0.5
    new, _ = sparsegpt_prune_weight(w.float(), h.float(), mask=keep, block=block, damp=0.01)
    torch.testing.assert_close(new.double(), column_by_column(w, damped(h, 0.01), keep), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("sparsity,n,m", [(0.5, 0, 0), (0.7, 0, 0), (0.0, 2, 4)])
def test_adaptive_mask_is_reconstructed_like_a_fixed_one_and_error_lies_between_the_bounds(sparsity, n, m):
    w, h = problem(8, 32, seed=4)
    new, keep = sparsegpt_prune_weight(w.float(), h.float(), sparsity, n, m, block=8, damp=0, mask_block=32)
    again, _ = sparsegpt_prune_weight(w.float(), h.float(), mask=keep, block=5, damp=0)
    torch.testing.assert_close(again, new, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(new.double(), column_by_column(w, h, keep), atol=2e-4, rtol=1e-4)
    e_new, e_zero = out_err(new.double(), w, h), out_err(w * keep, w, h)
    assert out_err(least_squares(w, h, keep), w, h) - 1e-6 <= e_new < e_zero
    scores = wanda_scores(w, h.diagonal().sqrt())  # Wanda's choice for these inputs, with its zeros not repaired
    wanda_keep = semi_structured_mask(scores) if m else unstructured_mask(scores, sparsity)
    assert e_new < out_err(w * wanda_keep, w, h)


# --------------------------------------------------------------------------------------- shapes and patterns


@settings(max_examples=40)
@given(rows=st.integers(1, 8), cols=st.integers(1, 40), block=st.integers(1, 48), mask_block=st.integers(1, 48),
       s=st.floats(0, 0.95), seed=st.integers(0, 2**16))
def test_unstructured_hits_the_sparsity_on_every_row(rows, cols, block, mask_block, s, seed):
    w, h = problem(rows, cols, seed)
    new, keep = sparsegpt_prune_weight(w.float(), h.float(), s, block=block, mask_block=mask_block)
    assert ((~keep).sum(1) == int(cols * s)).all()
    for i in range(0, cols, mask_block):  # and spread over the mask blocks as floor(s * end) - floor(s * start)
        e = min(i + mask_block, cols)
        assert ((~keep[:, i:e]).sum(1) == int(e * s) - int(i * s)).all()
    assert (new[~keep] == 0).all() and (new[keep] != 0).all() and torch.isfinite(new).all()


@settings(max_examples=30)
@given(rows=st.integers(1, 8), groups=st.integers(1, 12), per_block=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_2to4_keeps_two_of_every_four(rows, groups, per_block, seed):
    w, h = problem(rows, 4 * groups, seed)
    new, keep = sparsegpt_prune_weight(w.float(), h.float(), n=2, m=4, block=4 * per_block)
    assert is_n_m_sparse(new) and (keep.reshape(rows, groups, 4).sum(-1) == 2).all()
    assert torch.equal(new != 0, keep)


@pytest.mark.parametrize("block", [1, 7, 16, 40])
def test_the_lazy_block_size_changes_only_the_speed(block):
    w, h = problem(6, 40, seed=5)
    want, want_keep = sparsegpt_prune_weight(w.float(), h.float(), 0.6, block=40, mask_block=16)
    new, keep = sparsegpt_prune_weight(w.float(), h.float(), 0.6, block=block, mask_block=16)
    assert torch.equal(keep, want_keep)
    torch.testing.assert_close(new, want, atol=1e-5, rtol=1e-5)


def test_sparsity_zero_returns_the_weight_unchanged():
    w, h = problem(4, 16)
    for dtype in (torch.float32, torch.bfloat16):
        new, keep = sparsegpt_prune_weight(w.to(dtype), h.float(), 0.0)
        assert new.dtype == dtype and torch.equal(new, w.to(dtype)) and keep.all()


def test_bf16_weight_solved_in_float32_and_a_dead_input_tolerated():
    w, h = problem(4, 16)
    h[3, :], h[:, 3] = 0, 0  # input channel 3 is always zero
    new, keep = sparsegpt_prune_weight(w.bfloat16(), h.float(), 0.5, block=4)
    ref, _ = sparsegpt_prune_weight(w.bfloat16().float(), h.float(), 0.5, block=4)
    assert new.dtype == torch.bfloat16 and torch.equal(new, ref.bfloat16()) and ((~keep).sum(1) == 8).all()


def test_hessian_accumulator_is_the_mean_outer_product():
    x = torch.randn(3, 5, 6)
    acc = HessianAccumulator(6)
    acc.add(x[0])
    acc.add(x[1:])
    flat = x.reshape(-1, 6)
    torch.testing.assert_close(acc.hessian, flat.T @ flat / 15)


def test_bad_input():
    w, h = problem(4, 8)
    w, h = w.float(), h.float()
    for s in (1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match=r"\[0, 1\)"):
            sparsegpt_prune_weight(w, h, s)
    with pytest.raises(ValueError, match="NaN or inf"):
        sparsegpt_prune_weight(w, torch.full_like(h, float("nan")), 0.5)
    with pytest.raises(ValueError, match=r"\(8, 8\)"):
        sparsegpt_prune_weight(w, h[:4, :4], 0.5)
    with pytest.raises(ValueError, match="2-D"):
        sparsegpt_prune_weight(w[0], h, 0.5)
    with pytest.raises(ValueError, match="divide by 4"):
        sparsegpt_prune_weight(w[:, :6], h[:6, :6], n=2, m=4)
    with pytest.raises(ValueError, match="divide by 4"):
        sparsegpt_prune_weight(w, h, n=2, m=4, block=6)
    with pytest.raises(ValueError, match="0 < n < m"):
        sparsegpt_prune_weight(w, h, n=4, m=4)
    with pytest.raises(ValueError, match="sparsity=0 or 0.5"):
        sparsegpt_prune_weight(w, h, 0.6, n=2, m=4)
    with pytest.raises(ValueError, match="damp"):
        sparsegpt_prune_weight(w, h, 0.5, damp=-1)
    with pytest.raises(ValueError, match="block"):
        sparsegpt_prune_weight(w, h, 0.5, block=0)
    with pytest.raises(ValueError, match="mask_block"):
        sparsegpt_prune_weight(w, h, 0.5, mask_block=0)
    with pytest.raises(ValueError, match="raise damp"):  # rank 1 and no dampening: no inverse
        sparsegpt_prune_weight(w, torch.ones(8, 8), 0.5, damp=0)
    with pytest.raises(ValueError, match="bool tensor"):
        sparsegpt_prune_weight(w, h, mask=torch.ones(4, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="no calibration inputs"):
        _ = HessianAccumulator(8).hessian
    model = tiny_model(n_layers=1)
    with pytest.raises(ValueError, match="calib_ids"):
        prune_sparsegpt(model, 0.5)
    with pytest.raises(ValueError, match="pattern"):
        prune_sparsegpt(model, 0.5, "1:4", calib_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="sparsity is 0.5"):
        prune_sparsegpt(model, 0.6, "2:4", calib_ids=[1, 2, 3])


# --------------------------------------------------------------------------------------------------- a model


CALIB = torch.randint(0, 512, (512,), generator=torch.Generator().manual_seed(0)).tolist()


def output_error(model, ref, ids=CALIB, window=128) -> float:
    """Relative error of the final hidden states (before the LM head) against the unpruned model's."""
    x = torch.tensor([ids[i:i + window] for i in range(0, len(ids), window)])
    pos = torch.arange(window).expand_as(x)
    with torch.inference_mode():
        got, want = (mod.run_layers(mod.embed_tokens(x), pos) for mod in (model, ref))
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("pattern,s", [("unstructured", 0.5), ("2:4", 0.5), ("unstructured", 0.7)])
def test_prune_sparsegpt_hits_the_sparsity_and_beats_wanda_and_magnitude(pattern, s):
    ref = tiny_model(seed=1, n_layers=2)
    errs = {}
    for method in ("magnitude", "wanda", "sparsegpt"):
        model = copy.deepcopy(ref)
        if method == "sparsegpt":
            report = prune_sparsegpt(model, s, pattern, calib_ids=CALIB, window=128)
        else:
            prune(model, s, method, pattern, calib_ids=CALIB, window=128)
        errs[method] = output_error(model, ref)
    assert len(report) == 7 * 2 and torch.equal(model.embed.weight, ref.embed.weight)
    for r in report:
        lin = model.get_submodule(r["name"])
        zeros = (lin.weight == 0).sum(1)
        if pattern == "2:4":
            assert is_n_m_sparse(lin.weight), r["name"]
        else:
            assert (zeros == int(lin.in_features * s)).all(), r["name"]
        assert 0 < r["rel_error"] < 1
    assert errs["sparsegpt"] < errs["wanda"] and errs["sparsegpt"] < errs["magnitude"], errs


def test_prune_sparsegpt_in_bf16_and_sparsity_zero():
    ref = tiny_model(seed=2, n_layers=1)
    model = copy.deepcopy(ref)
    prune_sparsegpt(model, 0.0, calib_ids=CALIB[:128], window=64)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    model = copy.deepcopy(ref).to(torch.bfloat16)
    report = prune_sparsegpt(model, 0.5, "2:4", calib_ids=CALIB[:256], window=64)
    for r in report:
        w = model.get_submodule(r["name"]).weight
        assert w.dtype == torch.bfloat16 and is_n_m_sparse(w) and math.isfinite(r["rel_error"])


def test_prune_sparsegpt_equals_each_linear_pruned_on_the_pruned_blocks_outputs():
    """Oracle for the model-level loop: block by block, each Linear pruned alone (no stacking of the Linears that
    share an input) with the Hessian of what it receives once the blocks before it are pruned."""
    from minillm.compress.calibration import watch_inputs
    from minillm.compress.sparsity import _block_linears

    ref = tiny_model(seed=3, n_layers=2)
    got, want = copy.deepcopy(ref), copy.deepcopy(ref)
    prune_sparsegpt(got, 0.6, calib_ids=CALIB[:256], window=64, block=32)
    x = torch.tensor([CALIB[i:i + 64] for i in range(0, 256, 64)])
    pos = torch.arange(64).expand_as(x)
    with torch.inference_mode():
        h = want.embed_tokens(x)
        for i in range(2):
            linears = _block_linears(want.layers[i])
            acc = {name: HessianAccumulator(lin.in_features) for name, lin in linears.items()}
            with watch_inputs(linears, lambda name, a: acc[name].add(a)):
                want.run_layers(h, pos, layers=slice(i, i + 1))
            for name, lin in linears.items():
                lin.weight.copy_(sparsegpt_prune_weight(lin.weight, acc[name].hessian, 0.6, block=32)[0])
            h = want.run_layers(h, pos, layers=slice(i, i + 1))
    for (name, a), b in zip(got.named_parameters(), want.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)
