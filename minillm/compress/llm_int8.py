"""LLM.int8() (Dettmers et al., 2022): int8 activations x int8 weights, outlier features kept in float.

Beyond weight-only int8 (quant.py), each token's activation row gets its own int8 scale, so the matmul itself
runs in int8 with exact int32 accumulation (torch._int_mm). An outlier column (any |x| > threshold, 6.0) would
flatten the rest of its row to 0, so those columns are multiplied in float against the dequantized weight
columns (`int8_matmul_with_outliers`, `LLMInt8Linear`). `outlier_profile` counts them per Linear on the real
model. `int8_matvec`: the same integer product alone, for decode rows (1 byte read per weight). Lesson 07.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor, nn

from minillm.compress.calibration import run_windows, watch_inputs
from minillm.compress.quant import Int8Linear, quantize_int8


def quantize_rows_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (tokens, in) -> (int8 (tokens, in), scale float32 (tokens,)): one symmetric scale per row (token)."""
    amax = x.float().abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(x.float() / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def _int8_mm(a: Tensor, b_t: Tensor) -> Tensor:
    """int8 (m, k) @ int8 (n, k).T -> int32 (m, n). CUDA's _int_mm needs m > 16 and multiples of 8: pad rows."""
    m = a.shape[0]
    if a.is_cuda and m <= 16:
        a = torch.cat([a, a.new_zeros(17 - m, a.shape[1])])
    # k == 1: torch 2.13's CPU _int_mm misreads the (1, n) view with strides (1, 1) that .T gives: pass a real row
    return torch._int_mm(a, b_t.T if b_t.shape[1] > 1 else b_t.reshape(1, -1))[:m]


def int8_matvec(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """x (rows, in) float @ dequantize_int8(q, scale).T -> float32 (rows, out), never building the float weight.

    Each row of x gets its own int8 scale (quantize_rows_int8); the int8 x int8 product accumulates in int32 and
    reads the weight as stored, one byte per weight; the per-row scales of x and of q multiply the (rows, out)
    result. A batch-1 decode step reads every weight once, so this reads a quarter of a float32 weight's bytes."""
    if x.dim() != 2 or q.dim() != 2 or x.shape[1] != q.shape[1] or q.dtype != torch.int8 or \
            scale.shape != (q.shape[0],):
        raise ValueError(f"need x (rows, in), q int8 (out, in), scale (out,); got x {tuple(x.shape)}, q {q.dtype} "
                         f"{tuple(q.shape)}, scale {tuple(scale.shape)}")
    xq, xs = quantize_rows_int8(x)
    return _int8_mm(xq, q).float() * xs[:, None] * scale.float()[None, :]


def int8_matmul_with_outliers(x: Tensor, q: Tensor, scale: Tensor, threshold: float = 6.0) -> tuple[Tensor, Tensor]:
    """y ~= x @ (q * scale[:, None]).T with the LLM.int8() decomposition. Returns (y float32, outlier column mask).

    x (tokens, in) float; q int8 (out, in), scale (out,) per output row (from quantize_int8).
    Columns j with any |x[:, j]| > threshold are multiplied in float; the rest as int8 x int8 -> int32."""
    x = x.float()
    outliers = (x.abs() > threshold).any(dim=0)  # (in,)
    regular = x.masked_fill(outliers, 0.0)
    xq, xs = quantize_rows_int8(regular)
    y = _int8_mm(xq, q).float() * xs[:, None] * scale.float()[None, :]
    if outliers.any():
        w_cols = q[:, outliers].float() * scale.float()[:, None]  # the weights stay int8 in memory
        y = y + x[:, outliers] @ w_cols.T
    return y, outliers


class LLMInt8Linear(Int8Linear):
    """Same int8 storage as Int8Linear (per-row scales); a different matmul: int8 activations + float outliers."""

    def __init__(self, q: Tensor, scale: Tensor, threshold: float = 6.0):
        super().__init__(q, scale)
        self.threshold = threshold
        self.outlier_counts: list[int] | None = None  # set to [] to record the outlier columns of every call

    @classmethod
    def from_linear(cls, linear: nn.Linear, threshold: float = 6.0) -> LLMInt8Linear:
        if linear.bias is not None:
            raise ValueError("LLM.int8() here supports Linear layers without bias")
        if threshold <= 0:
            raise ValueError(f"threshold must be > 0 (the paper uses 6.0), got {threshold}")
        return cls(*quantize_int8(linear.weight.detach()), threshold=threshold)

    def uses_cpu_kernels(self) -> bool:
        return False  # its own matmul: int8 x int8 with float outlier columns

    def forward(self, x: Tensor) -> Tensor:
        y, outliers = int8_matmul_with_outliers(x.reshape(-1, x.shape[-1]), self.weight, self.scale, self.threshold)
        if self.outlier_counts is not None:
            self.outlier_counts.append(int(outliers.sum()))
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


@torch.inference_mode()
def outlier_profile(model: nn.Module, ids: list[int], threshold: float = 6.0, window: int = 256) -> dict[str, dict]:
    """For every Linear of a float model: how many input feature columns exceed `threshold` on `ids`, and the
    largest |activation| seen. Returns {name: {"outlier_columns": n, "in_features": k, "max_abs": v}}."""
    cols: dict[str, Tensor] = {}
    peak: dict[str, float] = defaultdict(float)

    def record(name: str, x: Tensor) -> None:
        x = x.abs()
        hit = (x > threshold).any(dim=0)
        cols[name] = cols[name] | hit if name in cols else hit
        peak[name] = max(peak[name], float(x.max()))

    linears = {name: m for name, m in model.named_modules() if isinstance(m, (nn.Linear, Int8Linear))}
    with watch_inputs(linears, record):
        run_windows(model, ids, window)
    return {n: {"outlier_columns": int(c.sum()), "in_features": c.numel(), "max_abs": peak[n]}
            for n, c in cols.items()}
