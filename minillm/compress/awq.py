"""AWQ (Lin et al., 2023): activation-aware scaling before 4-bit (or 3-bit) round-to-nearest (lesson 07).

A few input channels carry much larger activations, and the rounding error of their weights is multiplied by
them. AWQ scales input channel j of a Linear up by s_j = mean|x_j|^alpha before quantizing and divides the
input by s_j, folded into the op that produced it (the RMSNorm weight, or the up projection's rows before
down), so the float model computes the same. `search_scale` picks alpha per layer on calibration activations
(alpha = 0 is plain RTN); `apply_awq` rescales a float model in place, before `quantize`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from minillm.compress.calibration import run_windows, watch_inputs
from minillm.compress.quant import check_group_size, dequantize_int4, quantize_int4


def fake_quant(w: Tensor, group_size: int, bits: int) -> Tensor:
    return dequantize_int4(*quantize_int4(w, group_size, bits), group_size)


def _targets(block: nn.Module) -> list[tuple[str, list[nn.Linear], Tensor]]:
    """(the input's name, the Linears that read it, the weight whose last dim / rows produce it) per scalable input."""
    attn, mlp = block.attn, block.mlp
    if not hasattr(attn, "wq") or not hasattr(mlp, "gate"):
        raise ValueError("apply AWQ to an unfused model (load it with fuse=False), then fuse or quantize it")
    # wo is left alone: its input comes out of attention, and with GQA each value head is shared by several
    # query heads, so no single op could absorb the division by s
    return [("attn_in", [attn.wq, attn.wk, attn.wv], block.attn_norm.weight),
            ("mlp_in", [mlp.gate, mlp.up], block.mlp_norm.weight),
            ("down_in", [mlp.down], mlp.up.weight)]


@torch.inference_mode()
def collect_activations(model: nn.Module, ids: list[int], window: int = 256, keep_rows: int = 256) -> list[dict]:
    """Per block: {input name: (mean |x| per channel (in,), up to keep_rows sample rows (n, in))}, float32."""
    stats: list[dict] = [dict() for _ in model.layers]

    def record(key: tuple[int, str], x: Tensor) -> None:
        i, name = key
        total, n, rows = stats[i].get(name, (0.0, 0, []))
        rows.append(x[torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(i))[:keep_rows]])
        stats[i][name] = (total + x.abs().sum(0), n + x.shape[0], rows)

    readers = {(i, name): linears[0] for i, block in enumerate(model.layers) for name, linears, _ in _targets(block)}
    with watch_inputs(readers, record):
        run_windows(model, ids, window)
    return [{k: (total / n, torch.cat(rows)[:keep_rows]) for k, (total, n, rows) in s.items()} for s in stats]


def search_scale(linears: list[nn.Linear], x: Tensor, mean_abs: Tensor, group_size: int, bits: int,
                 grid: int = 20) -> tuple[Tensor, float, float]:
    """The per-channel scale s = mean_abs^alpha (alpha in 0, 1/grid, ..., 1) that minimises the quantized
    layers' output error on x. Returns (s, best alpha, error at alpha=0 / best error: the gain over RTN)."""
    weights = [lin.weight.detach().float() for lin in linears]
    want = [x @ w.T for w in weights]
    best, errors = None, []
    for i in range(grid + 1):
        alpha = i / grid
        s = mean_abs.clamp(min=1e-5).pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # centre the scales around 1: only their ratios matter
        err = sum(float((x @ (fake_quant(w * s, group_size, bits) / s).T - y).pow(2).sum())
                  for w, y in zip(weights, want))
        errors.append(err)
        if best is None or err < best[2]:
            best = (s, alpha, err)
    return best[0], best[1], errors[0] / max(best[2], 1e-30)


@torch.inference_mode()
def apply_awq(model: nn.Module, calib_ids: list[int], group_size: int = 64, bits: int = 4, grid: int = 20,
              window: int = 256) -> list[dict]:
    """Rescale the float model in place (its outputs do not change, up to float rounding) so that quantizing it
    next with quantize(model, "int4", group_size) or fake_quantize_int4(model, group_size, bits) loses less.
    Returns one record per scaled input: block, input, alpha, gain (RTN error / AWQ error on the calibration rows)."""
    if any(not isinstance(m, nn.Linear) for b in model.layers for _, ls, _ in _targets(b) for m in ls):
        raise ValueError("AWQ rescales float weights: apply it before quantize(), not after")
    for _, ls, _ in _targets(model.layers[0]):
        check_group_size(ls[0].in_features, group_size)
    stats = collect_activations(model, calib_ids, window)
    report = []
    for i, block in enumerate(model.layers):
        for name, linears, producer in _targets(block):
            mean_abs, x = stats[i][name]
            s, alpha, gain = search_scale(linears, x.to(mean_abs.device), mean_abs, group_size, bits, grid)
            for lin in linears:
                lin.weight.mul_(s.to(lin.weight.dtype))
            if producer.dim() == 1:  # an RMSNorm weight: its output channel j is divided by s_j
                producer.div_(s.to(producer.dtype))
            else:  # the up projection: its output row j feeds down's input channel j
                producer.div_(s.to(producer.dtype)[:, None])
            report.append({"block": i, "input": name, "alpha": alpha, "gain": gain})
    return report
