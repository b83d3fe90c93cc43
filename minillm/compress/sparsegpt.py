"""SparseGPT (Frantar & Alistarh, 2023): prune a layer, then repair the weights it keeps (lesson 08).

Magnitude and Wanda only choose which weights to zero; the output error of the zeros stays. SparseGPT solves for it:
with H = X X^T of the layer's calibration inputs, each pruned weight's error is spread over the not-yet-processed
weights of its row by the Optimal Brain Surgeon update, read off the Cholesky factor of H^-1 (no per-row inverse),
columns left to right in blocks whose updates reach the rest of the matrix in one matmul; the mask is chosen as it
goes, from w^2 / [H^-1]_jj^2. The cost it removes: an inverse Hessian per row (rows x cols^3) — one Cholesky serves all.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from minillm.compress.calibration import calib_batch, watch_inputs
from minillm.compress.sparsity import _block_linears, check_sparsity, semi_structured_mask


class HessianAccumulator:
    """The mean of x x^T over calibration tokens (in, in), float32: `add` each batch of inputs (..., in)."""

    def __init__(self, in_features: int, device=None):
        self.sum = torch.zeros(in_features, in_features, device=device)
        self.tokens = 0

    def add(self, x: Tensor) -> None:
        x = x.reshape(-1, self.sum.shape[0]).float()
        self.sum.addmm_(x.T, x)
        self.tokens += x.shape[0]

    @property
    def hessian(self) -> Tensor:
        if not self.tokens:
            raise ValueError("no calibration inputs were added: run calibration text through the layer first")
        return self.sum / self.tokens


def _check(weight: Tensor, hessian: Tensor, sparsity: float, n: int, m: int, block: int, damp: float,
           mask: Tensor | None) -> None:
    check_sparsity(sparsity)
    if weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D (out_features, in_features) matrix, got shape {tuple(weight.shape)}")
    cols = weight.shape[1]
    if hessian.shape != (cols, cols):
        raise ValueError(f"hessian must be (in_features, in_features) = ({cols}, {cols}), got {tuple(hessian.shape)}: "
                         "accumulate it from this layer's inputs (HessianAccumulator)")
    if not torch.isfinite(hessian).all() or not torch.isfinite(weight).all():
        raise ValueError("the weight or the Hessian contains NaN or inf: check the calibration activations "
                         "(a NaN in the model's output, or an overflow in a low-precision dtype)")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block is a number of columns >= 1, got {block!r}")
    if not (isinstance(damp, (int, float)) and math.isfinite(damp) and damp >= 0):
        raise ValueError(f"damp is a fraction of the mean Hessian diagonal, >= 0 (0.01 is usual), got {damp!r}")
    if n or m:
        if not 0 < n < m:
            raise ValueError(f"an n:m pattern keeps 0 < n < m weights per group, got {n}:{m}")
        if cols % m or block % m:
            raise ValueError(f"{n}:{m} groups each row in runs of {m}: in_features ({cols}) and block ({block}) must "
                             f"divide by {m} (prune this layer unstructured, or pick a block that is a multiple)")
        if sparsity not in (0.0, (m - n) / m):
            raise ValueError(f"{n}:{m} fixes the sparsity at {(m - n) / m}: pass sparsity=0 or {(m - n) / m}")
    if mask is not None and (mask.shape != weight.shape or mask.dtype != torch.bool):
        raise ValueError(f"mask must be a bool tensor of the weight's shape {tuple(weight.shape)} (True = keep)")


def _inverse_hessian_factor(hessian: Tensor, damp: float) -> Tensor:
    """U, upper triangular, with U^T U = (H + damp * mean(diag H) * I)^-1. Row j of U is the j-th column of the
    inverse Hessian of the columns j.. (the ones still free), divided by the square root of its diagonal entry."""
    h = hessian.detach().float().clone()
    diag = h.diagonal()
    diag[diag == 0] = 1.0  # an input that is always zero: its weights touch nothing, any positive curvature will do
    diag += damp * float(diag.mean())
    try:
        inv = torch.cholesky_inverse(torch.linalg.cholesky(h))
        return torch.linalg.cholesky(inv, upper=True)
    except torch.linalg.LinAlgError as e:
        raise ValueError("the Hessian is not positive definite after dampening: raise damp (e.g. 0.1) or calibrate "
                         "on more tokens than the layer has inputs") from e


def sparsegpt_prune_weight(weight: Tensor, hessian: Tensor, sparsity: float = 0.0, n: int = 0, m: int = 0,
                           block: int = 128, damp: float = 0.01, mask: Tensor | None = None,
                           mask_block: int = 128) -> tuple[Tensor, Tensor]:
    """Prune weight (out, in) and update the weights it keeps to minimise ||(W' - W) X||^2 for the inputs X whose
    `hessian` (in, in) = mean x x^T. Returns (new weight, in weight's dtype; mask, True = kept).

    Unstructured: each row loses exactly floor(sparsity * in) weights, floor(sparsity * i2) - floor(sparsity * i1)
    of them in each mask block of columns [i1, i2) (mask_block wide), chosen when the block starts. n:m (e.g. n=2,
    m=4): each run of m columns keeps its n best, chosen when the run starts. Both pick the weights whose removal
    costs least by OBS, w^2 / [H^-1]_jj^2, on the already-updated weights. `mask` (bool, True = keep) skips the
    choice and only reconstructs. `block` columns share one lazy update (speed only: the result does not depend on
    it). The solve is float32 whatever weight's dtype; damp adds damp * mean(diag H) to H's diagonal."""
    _check(weight, hessian, sparsity, n, m, block, damp, mask)
    if not isinstance(mask_block, int) or mask_block < 1:
        raise ValueError(f"mask_block is a number of columns >= 1, got {mask_block!r}")
    if mask is None and sparsity == 0 and not m:
        return weight.detach().clone(), torch.ones_like(weight, dtype=torch.bool)
    w = weight.detach().float().clone()
    rows, cols = w.shape
    u = _inverse_hessian_factor(hessian.to(w.device), damp)
    keep = torch.ones_like(w, dtype=torch.bool) if mask is None else mask.to(w.device).clone()
    choose = mask is None and not m and sparsity > 0
    # lazy blocks start every `block` columns and at every mask block (where all columns right are up to date)
    starts = sorted(set(range(0, cols, block)) | (set(range(0, cols, mask_block)) if choose else set()))
    for i1, i2 in zip(starts, starts[1:] + [cols]):
        if choose and i1 % mask_block == 0:  # adaptive: this mask block's zeros, chosen from the updated weights
            e = min(i1 + mask_block, cols)
            n_drop = math.floor(sparsity * e) - math.floor(sparsity * i1)
            drop = torch.topk(w[:, i1:e].pow(2) / u.diagonal()[i1:e].pow(2), n_drop, dim=1, largest=False).indices
            keep[:, i1:e].scatter_(1, drop, False)
        w1, u1 = w[:, i1:i2].clone(), u[i1:i2, i1:i2]
        d1 = u1.diagonal()
        err1 = torch.zeros_like(w1)
        for j in range(i2 - i1):
            if mask is None and m and j % m == 0:
                keep[:, i1 + j:i1 + j + m] = semi_structured_mask(w1[:, j:j + m].pow(2) / d1[j:j + m].pow(2), n, m)
            err = torch.where(keep[:, i1 + j], 0.0, w1[:, j] / d1[j])  # (w - q) / U_jj, q = w kept or 0 pruned
            w1[:, j:].addr_(err, u1[j, j:], alpha=-1)  # OBS: the free columns absorb the error (a rank-1 update)
            err1[:, j] = err
        w[:, i1:i2] = w1 * keep[:, i1:i2]  # pruned columns are exactly 0 (not a rounding residue)
        w[:, i2:] -= err1 @ u[i1:i2, i2:]  # the lazy batch update: the block's errors reach the rest at once
    return w.to(weight.dtype), keep


def reconstruction_error(old: Tensor, new: Tensor, hessian: Tensor) -> float:
    """||(new - old) X||^2 / ||old X||^2 on the calibration inputs, from H = mean x x^T: the layer's relative error."""
    d, o = (new.float() - old.float()), old.float()
    h = hessian.float()
    return float(((d @ h) * d).sum() / ((o @ h) * o).sum().clamp_min(1e-30))


@torch.inference_mode()
def prune_sparsegpt(model: nn.Module, sparsity: float, pattern: str = "unstructured",
                    calib_ids: list[int] | None = None, window: int = 256, block: int = 128,
                    damp: float = 0.01, mask_block: int = 128) -> list[dict]:
    """SparseGPT on every Linear in the blocks (the embedding / tied LM head stay dense), in place; the drop-in twin
    of sparsity.prune(model, sparsity, "wanda", pattern, calib_ids, window=window).

    Block i's Linears are calibrated on the outputs of the already-pruned blocks 0..i-1 (one forward of block i
    collects all seven Hessians before any of them is pruned), then block i runs again, pruned, for block i+1.
    pattern: "unstructured" or "2:4" (pass sparsity=0.5). Returns one record per Linear: {"name", "shape",
    "sparsity", "rel_error"}, rel_error = the pruned layer's relative output error on the calibration inputs."""
    check_sparsity(sparsity)
    if pattern not in ("unstructured", "2:4"):
        raise ValueError(f"unknown pattern {pattern!r}: 'unstructured' or '2:4'")
    if pattern == "2:4" and sparsity != 0.5:
        raise ValueError(f"2:4 keeps 2 of every 4 weights: its sparsity is 0.5, got sparsity={sparsity}")
    if not calib_ids:
        raise ValueError("SparseGPT reconstructs each layer from its input activations: pass calib_ids "
                         "(e.g. minillm.compress.quality.calibration_ids(tok, 512))")
    if any(not isinstance(mod, nn.Linear) for b in model.layers for mod in b.modules()
           if type(mod).__name__.endswith("Linear") and mod is not b):
        raise ValueError("prune a float model: quantized layers have no float weight to mask (prune, then quantize)")
    n, m = (2, 4) if pattern == "2:4" else (0, 0)
    x = calib_batch(model, calib_ids, window)
    positions = torch.arange(x.shape[1], device=x.device).expand_as(x)
    h = model.embed_tokens(x)
    report = []
    for i, blk in enumerate(model.layers):
        linears = _block_linears(blk)
        acc = {name: HessianAccumulator(lin.in_features, lin.weight.device) for name, lin in linears.items()}
        with watch_inputs(linears, lambda name, a: acc[name].add(a)):
            model.run_layers(h, positions, layers=slice(i, i + 1))  # block i's inputs, from pruned 0..i-1
        groups: list[tuple[Tensor, list[str]]] = []  # Linears that read one input (wq/wk/wv, gate/up) share H
        for name in linears:
            hess = acc[name].hessian
            same = next((names for g, names in groups if torch.equal(g, hess)), None)
            if same is None:
                groups.append((hess, [name]))
            else:
                same.append(name)
        for hess, names in groups:  # rows are pruned independently: stacked, they share one factorisation
            stacked = torch.cat([linears[name].weight for name in names])
            new, _ = sparsegpt_prune_weight(stacked, hess, 0.0 if m else sparsity, n, m, block, damp,
                                            mask_block=mask_block)
            for name, part_new in zip(names, new.split([linears[name].out_features for name in names])):
                lin = linears[name]
                rel = reconstruction_error(lin.weight, part_new, hess)
                lin.weight.copy_(part_new)
                report.append({"name": f"layers.{i}.{name}", "shape": tuple(lin.weight.shape),
                               "sparsity": float((lin.weight == 0).float().mean()), "rel_error": rel})
        h = model.run_layers(h, positions, layers=slice(i, i + 1))  # what block i+1 will see
    return report
