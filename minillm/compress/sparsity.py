"""Unstructured and 2:4 sparsity: which weights to zero, and what zeros are worth (lesson 08).

Magnitude drops the smallest |W|; Wanda (Sun et al., 2023) drops the smallest |W[i, j]| x ||X_j||, compared within
each output row, from one calibration pass (`magnitude_scores`, `wanda_scores`, `unstructured_mask`). Scattered
zeros speed up no dense kernel; 2:4 (two of every four consecutive weights kept: `semi_structured_mask`,
`compress_2to4`) is what NVIDIA's sparse tensor cores skip. `prune` calibrates each block on the outputs of the
already-pruned blocks before it. Structured pruning (a smaller dense model) is in pruning.py.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from minillm.compress.calibration import calib_batch, watch_inputs


def check_sparsity(sparsity: float) -> float:
    if not isinstance(sparsity, (int, float)) or math.isnan(sparsity) or not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity is the fraction of weights to zero, in [0, 1): got {sparsity!r}")
    return float(sparsity)


def _check_scores(scores: Tensor) -> None:
    if scores.dim() != 2:
        raise ValueError(f"scores must be a 2-D (out_features, in_features) matrix, got shape {tuple(scores.shape)}")
    if not torch.isfinite(scores).all():
        raise ValueError("the importance scores contain NaN or inf: check the calibration activations "
                         "(a NaN in the model's output, or an overflow in a low-precision dtype)")


def magnitude_scores(weight: Tensor) -> Tensor:
    return weight.detach().float().abs()


def wanda_scores(weight: Tensor, act_norm: Tensor) -> Tensor:
    """|W[i, j]| * ||X_j||_2: weight (out, in), act_norm (in,) = the L2 norm of input channel j over the tokens."""
    if act_norm.shape != weight.shape[1:]:
        raise ValueError(f"act_norm must have one entry per input channel ({weight.shape[1]}), "
                         f"got shape {tuple(act_norm.shape)}")
    return weight.detach().float().abs() * act_norm.float()[None, :]


def unstructured_mask(scores: Tensor, sparsity: float, per_row: bool = True) -> Tensor:
    """True = keep. Zero the lowest-scoring `sparsity` of each output row (per_row, Wanda's comparison group) or of
    the whole matrix (per_row=False, classic magnitude pruning). Exactly floor(sparsity * n) are zeroed per group."""
    check_sparsity(sparsity)
    _check_scores(scores)
    flat = scores if per_row else scores.reshape(1, -1)
    n_drop = int(flat.shape[1] * sparsity)
    mask = torch.ones_like(flat, dtype=torch.bool)
    if n_drop:
        drop = torch.sort(flat, dim=1, stable=True).indices[:, :n_drop]  # stable: ties drop the earlier column
        mask.scatter_(1, drop, False)
    return mask.reshape(scores.shape)


def semi_structured_mask(scores: Tensor, n: int = 2, m: int = 4) -> Tensor:
    """True = keep: the n highest-scoring weights of every m consecutive ones along each row (2:4 by default)."""
    _check_scores(scores)
    if not 0 < n < m:
        raise ValueError(f"an n:m pattern keeps 0 < n < m weights per group, got {n}:{m}")
    if scores.shape[1] % m:
        raise ValueError(f"{n}:{m} sparsity groups each row in runs of {m}: in_features {scores.shape[1]} is not "
                         f"divisible by {m} (prune this layer unstructured, or leave it dense)")
    groups = scores.reshape(scores.shape[0], -1, m)
    keep = torch.topk(groups, n, dim=-1, sorted=False).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
    return mask.reshape(scores.shape)


def is_n_m_sparse(weight: Tensor, n: int = 2, m: int = 4) -> bool:
    """Every group of m consecutive weights of each row holds at most n nonzeros."""
    return bool(((weight.reshape(weight.shape[0], -1, m) != 0).sum(-1) <= n).all())


# ------------------------------------------------------------------------------------------- the 2:4 format


def compress_2to4(weight: Tensor) -> tuple[Tensor, Tensor]:
    """A 2:4-sparse weight (out, in) -> (values (out, in/2), metadata uint8 (out, in/8)): the two kept values of
    each group of 4, and their two 2-bit positions (4 bits per group, two groups per byte). The layout of NVIDIA's
    sparse tensor cores in spirit (their metadata is interleaved for the hardware; the byte count is the same)."""
    out_f, in_f = weight.shape
    if in_f % 8:
        raise ValueError(f"compress_2to4 packs two groups of 4 per metadata byte: in_features {in_f} must divide by 8")
    if not is_n_m_sparse(weight):
        raise ValueError("the weight is not 2:4 sparse: apply semi_structured_mask first")
    groups = weight.reshape(out_f, -1, 4)
    # the positions of the 2 kept weights, in order: nonzeros first (stable sort keeps their order), zero-padded
    # groups (fewer than 2 nonzeros) keep a zero value at the first free position
    order = torch.sort((groups == 0).to(torch.uint8), dim=-1, stable=True).indices[..., :2]
    order = torch.sort(order, dim=-1).values
    values = torch.gather(groups, -1, order).reshape(out_f, in_f // 2)
    nibble = (order[..., 0] | (order[..., 1] << 2)).to(torch.uint8)  # (out, in/4): 4 bits per group
    meta = nibble[:, 0::2] | (nibble[:, 1::2] << 4)
    return values, meta


def decompress_2to4(values: Tensor, meta: Tensor) -> Tensor:
    out_f, half = values.shape
    nibble = torch.stack([meta & 0xF, meta >> 4], dim=-1).reshape(out_f, -1).long()  # (out, in/4)
    pos = torch.stack([nibble & 0x3, nibble >> 2], dim=-1)  # (out, in/4, 2)
    dense = torch.zeros(out_f, half // 2, 4, dtype=values.dtype, device=values.device)
    dense.scatter_(-1, pos, values.reshape(out_f, -1, 2))
    return dense.reshape(out_f, half * 2)


def format_bytes(shape: tuple[int, int], sparsity: float, value_bytes: int = 2) -> dict[str, int]:
    """Bytes to store an (out, in) weight: dense, 2:4 (values + 4 bits per group of 4), and CSR at `sparsity`
    (values + an int16 column index per kept weight + an int32 offset per row): what each format really costs."""
    out_f, in_f = shape
    kept = out_f * (in_f - int(in_f * sparsity))
    return {"dense": out_f * in_f * value_bytes,
            "2:4": out_f * in_f // 2 * value_bytes + out_f * in_f // 8,
            "csr": kept * (value_bytes + 2) + (out_f + 1) * 4}


# --------------------------------------------------------------------------------------- pruning a model


def _block_linears(block: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in block.named_modules() if isinstance(m, nn.Linear)}


@torch.inference_mode()
def prune(model: nn.Module, sparsity: float, method: str = "wanda", pattern: str = "unstructured",
          calib_ids: list[int] | None = None, per_row: bool | None = None, window: int = 256) -> list[dict]:
    """Zero weights of every Linear in the blocks (the embedding / tied LM head stay dense), in place.

    method: "magnitude" or "wanda" (needs calib_ids). pattern: "unstructured" (at `sparsity`) or "2:4" (sparsity is
    50% by construction; pass sparsity=0.5). per_row: the comparison group, default Wanda's per output row for
    wanda and the whole matrix for magnitude (the classic baselines). Returns one record per Linear:
    {"name", "shape", "sparsity"} (the fraction of zeros now in the weight)."""
    check_sparsity(sparsity)
    if method not in ("magnitude", "wanda"):
        raise ValueError(f"unknown method {method!r}: 'magnitude' or 'wanda'")
    if pattern not in ("unstructured", "2:4"):
        raise ValueError(f"unknown pattern {pattern!r}: 'unstructured' or '2:4'")
    if pattern == "2:4" and sparsity != 0.5:
        raise ValueError(f"2:4 keeps 2 of every 4 weights: its sparsity is 0.5, got sparsity={sparsity}")
    if method == "wanda" and not calib_ids:
        raise ValueError("Wanda scores weights by their input activations: pass calib_ids "
                         "(e.g. minillm.compress.quality.calibration_ids(tok, 512))")
    if any(not isinstance(m, nn.Linear) for b in model.layers for m in b.modules()
           if type(m).__name__.endswith("Linear") and m is not b):
        raise ValueError("prune a float model: quantized layers have no float weight to mask (prune, then quantize)")
    per_row = (method == "wanda") if per_row is None else per_row

    def mask_for(lin: nn.Linear, norm: Tensor | None) -> Tensor:
        scores = wanda_scores(lin.weight, norm) if norm is not None else magnitude_scores(lin.weight)
        return semi_structured_mask(scores) if pattern == "2:4" else unstructured_mask(scores, sparsity, per_row)

    report = []
    if method == "wanda":
        x = calib_batch(model, calib_ids, window)
        positions = torch.arange(x.shape[1], device=x.device).expand_as(x)
        h = model.embed_tokens(x)
    for i, block in enumerate(model.layers):
        linears = _block_linears(block)
        norms = {name: None for name in linears}
        if method == "wanda":
            sq = {}

            def record(name: str, a: Tensor) -> None:
                sq[name] = sq.get(name, 0.0) + a.pow(2).sum(0)

            with watch_inputs(linears, record):
                model.run_layers(h, positions, layers=slice(i, i + 1))  # block i's inputs, from pruned 0..i-1
            norms = {name: sq[name].sqrt() for name in linears}
        for name, lin in linears.items():
            lin.weight.mul_(mask_for(lin, norms[name]).to(lin.weight.dtype))
            report.append({"name": f"layers.{i}.{name}", "shape": tuple(lin.weight.shape),
                           "sparsity": float((lin.weight == 0).float().mean())})
        if method == "wanda":
            h = model.run_layers(h, positions, layers=slice(i, i + 1))  # what block i+1 will see
    return report


def sparsity_of(model: nn.Module) -> float:
    """The fraction of zeros over the weights of every Linear in the blocks."""
    zeros = total = 0
    for block in model.layers:
        for lin in _block_linears(block).values():
            zeros += int((lin.weight == 0).sum())
            total += lin.weight.numel()
    return zeros / total
