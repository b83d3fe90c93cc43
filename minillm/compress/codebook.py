"""Shared codebooks (weight sharing, SqueezeLLM-style non-uniform quantization): lesson 07's other 3/4-bit format.

Uniform int4/3-bit spaces its 2**bits levels evenly between a group's min and max, so most levels sit in the tails
where few weights live. Here each output row gets 8 or 16 shared values found by 1-D k-means (optionally weighted
by each weight's sensitivity: the Fisher diagonal, as SqueezeLLM), and stores a 3/4-bit index per weight plus the
small table (and optionally the largest weights exactly: SqueezeLLM's dense-and-sparse): the levels follow the
distribution, so the same bits can lose less. `codebook_quantize` swaps the blocks' Linears for `CodebookLinear`;
lesson 07 teaches it beside round-to-nearest and AWQ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minillm.compress.calibration import run_windows, watch_inputs
from minillm.compress.quant import QuantizedLinear, cpu_kernels, is_quantized

SENSITIVITIES = {None: "plain k-means (every weight counts the same)",
                 "fisher": "squared gradients of the calibration loss summed over its windows (SqueezeLLM)",
                 "activation": "E[x_j^2] of the layer's input channel j on calibration text (AWQ/GPTQ-style proxy)"}


# ------------------------------------------------------------------------------------------ 1-D weighted k-means

def _edges(xs: Tensor, centers: Tensor) -> Tensor:
    """Sorted rows xs (r, n), ascending centers (r, k) -> (r, k + 1) cluster edges into xs: cluster j is the
    slice [e_j, e_j+1), every value nearest its center (a value on a midpoint goes to the lower center)."""
    mid = (centers[:, 1:] + centers[:, :-1]) / 2
    inner = torch.searchsorted(xs, mid.contiguous(), right=True)
    r, n = xs.shape
    return torch.cat([inner.new_zeros(r, 1), inner, inner.new_full((r, 1), n)], dim=1)


def _clusters(edges: Tensor, n: int) -> Tensor:
    """The cluster of each sorted position (r, n): how many inner edges are <= it."""
    inner = edges[:, 1:-1]
    marks = torch.zeros(len(edges), n + 1, dtype=torch.long).scatter_add_(1, inner, torch.ones_like(inner))
    return marks[:, :n].cumsum(1)


def _lloyd(xs: Tensor, cum_w: Tensor, cum_wx: Tensor, centers: Tensor, max_iter: int) -> Tensor:
    """Lloyd steps from `centers` until no row's clusters change (or max_iter). A center whose cluster is empty (or
    has no weight) is wasted: it jumps to the value with the largest weighted error, which lowers the loss. Rows that
    stopped leave the working set in bulk, once they are half of it (each departure copies the rest)."""
    centers, ids, wc = centers.clone(), torch.arange(len(xs)), centers
    prev = torch.full((len(xs), centers.shape[1] + 1), -1, dtype=torch.long)
    for _ in range(max_iter):
        edges = _edges(xs, wc)
        moved = (edges != prev).any(1)
        sw, swx = cum_w.gather(1, edges).diff(dim=1), cum_wx.gather(1, edges).diff(dim=1)
        # a new center is the mean of its cluster, clamped into the cluster's range (prefix-sum differences cancel);
        # clusters are ordered runs and an unchanged center lies between its midpoints: ascending without a sort
        n = xs.shape[1]
        lo, hi = xs.gather(1, edges[:, :-1].clamp(max=n - 1)), xs.gather(1, (edges[:, 1:] - 1).clamp(min=0))
        mean = torch.minimum(torch.maximum(swx / sw.clamp(min=1e-300), lo.double()), hi.double())
        wc, prev = torch.where(sw > 0, mean, wc.double()).float(), edges
        dead = (sw <= 0).nonzero()  # (row, center) pairs; one jump per row and step
        if len(dead):
            rows, first = dead[:, 0].unique_consecutive(return_counts=True)
            which = dead[first.cumsum(0) - first, 1]
            err = cum_w[rows].diff(dim=1) * (xs[rows] - wc[rows].gather(1, _clusters(edges[rows], xs.shape[1]))) ** 2
            worst, at = err.max(1)
            jump = worst > 0
            rows, which, at = rows[jump], which[jump], at[jump]
            wc[rows, which] = xs[rows, at]
            wc[rows] = wc[rows].sort(dim=1).values
            moved[rows] = True
        n_moved = int(moved.sum())
        if not n_moved:
            break
        if n_moved <= len(ids) // 2:
            centers[ids] = wc
            keep = moved.nonzero()[:, 0]
            ids, xs, cum_w, cum_wx, wc, prev = ids[keep], xs[keep], cum_w[keep], cum_wx[keep], wc[keep], prev[keep]
    centers[ids] = wc
    return centers


def kmeans_1d(x: Tensor, k: int, weight: Tensor | None = None, max_iter: int = 100) -> tuple[Tensor, Tensor]:
    """Weighted 1-D k-means of every row of x (rows, n) at once -> (centers (rows, k) ascending float32,
    index (rows, n) int64 into that row's centers). Deterministic: no random restarts.

    Minimises sum_i weight_i * (x_i - center[index_i])**2 per row. In 1-D a cluster is a run of the sorted values, so
    a Lloyd step is a searchsorted of the midpoints plus two prefix sums: O(k log n) per row, not O(n k). Lloyd stops
    at a local optimum, so it runs from two starts and each row keeps the better: the weighted quantiles (i + 1/2) / k
    (a row with <= k distinct values: exactly those values), and the uniform grid min..max, which keeps centers out
    in the tails (and so never loses to uniform min/max quantization of the row: Lloyd only lowers the loss). A center
    left with no weight jumps to the worst-served value. Stops when no row's clusters change, or after max_iter."""
    if x.dim() != 2 or k < 1:
        raise ValueError(f"kmeans_1d needs x (rows, n) and k >= 1, got shape {tuple(x.shape)}, k={k}")
    x = x.float()
    w = torch.ones_like(x) if weight is None else weight.float()
    if w.shape != x.shape or not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError("weight must be finite, >= 0 and shaped like x")
    r, n = x.shape
    xs, order = x.sort(dim=1)
    ws = w.gather(1, order).double()
    zero = ws.new_zeros(r, 1)
    cum_w = torch.cat([zero, ws.cumsum(1)], 1)  # prefix sums in float64: cluster sums are differences of them
    cum_wx = torch.cat([zero, (ws * xs).cumsum(1)], 1)
    cum_wxx = torch.cat([zero, (ws * xs * xs).cumsum(1)], 1)
    # start 1: weighted quantiles (a row with no weight at all: plain ones)
    init_w = torch.where(cum_w[:, -1:] > 0, cum_w[:, 1:], torch.arange(1, n + 1, dtype=torch.float64).expand(r, n))
    targets = (torch.arange(k, dtype=torch.float64) + 0.5) / k * init_w[:, -1:]
    quantiles = xs.gather(1, torch.searchsorted(init_w.contiguous(), targets.contiguous()).clamp(max=n - 1))
    new_value = xs[:, 1:] != xs[:, :-1]
    few = new_value.sum(1) < k  # <= k distinct values: the values themselves, the spare centers on the largest
    if bool(few.any()):
        rank = F.pad(new_value[few].long().cumsum(1), (1, 0))
        quantiles[few] = xs[few, -1:].repeat(1, k).scatter(1, rank, xs[few])
    # start 2: the uniform grid
    grid = xs[:, :1] + (xs[:, -1:] - xs[:, :1]) * torch.linspace(0, 1, k) if k > 1 else quantiles
    best = None
    for start in (quantiles, grid):
        centers = _lloyd(xs, cum_w, cum_wx, start, max_iter)
        edges = _edges(xs, centers)
        sw, swx, swxx = (c.gather(1, edges).diff(dim=1) for c in (cum_w, cum_wx, cum_wxx))
        c = centers.double()  # the loss of each cluster from its sums: sum w x^2 - 2 c sum w x + c^2 sum w
        loss = (swxx - 2 * c * swx + c * c * sw).sum(1)
        if best is None:
            best = centers, edges, loss
        else:
            better = (loss < best[2])[:, None]
            best = (torch.where(better, centers, best[0]), torch.where(better, edges, best[1]),
                    torch.minimum(loss, best[2]))
    return best[0], torch.empty_like(order).scatter_(1, order, _clusters(best[1], n))


# ------------------------------------------------------------------------------------------ index packing

def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """codes (rows, n) in [0, 2**bits) -> uint8 (rows, ceil(n / 8) * bits): one little-endian bit stream per row,
    so 3-bit codes take 3 bytes per 8 weights, 4-bit ones are exactly pack_int4's nibbles, 8-bit ones raw bytes."""
    rows, n = codes.shape
    if bits == 8:
        return codes.to(torch.uint8)
    c = F.pad(codes.long(), (0, -n % 8)).reshape(rows, -1, 8)
    stream = (c << (bits * torch.arange(8))).sum(-1)  # 8 codes in 8 * bits <= 56 bits of an int64
    return ((stream[..., None] >> (8 * torch.arange(bits))) & 0xFF).to(torch.uint8).reshape(rows, -1)


def unpack_codes(packed: Tensor, bits: int, n: int) -> Tensor:
    """The inverse of pack_codes: uint8 (rows, ceil(n / 8) * bits) -> int64 codes (rows, n)."""
    if bits == 8:
        return packed.long()
    b = packed.long().reshape(packed.shape[0], -1, bits)
    stream = (b << (8 * torch.arange(bits))).sum(-1)
    return ((stream[..., None] >> (bits * torch.arange(8))) & (2 ** bits - 1)).flatten(1)[:, :n]


# ------------------------------------------------------------------------------------------ the layer

class CodebookLinear(QuantizedLinear):
    """A Linear stored as a `bits`-bit index per weight (packed, `pack_codes`) and a table of 2**bits float16 values
    per group of `rows_per_codebook` output rows (1: per output channel, as SqueezeLLM; out_features: one per layer),
    plus optionally a few outlier weights kept exactly (float16 value + int32 position: SqueezeLLM's dense-and-sparse).

    forward on the CPU, 3 or 4 bits: the LUT kernel (kernels/cpu/codebook_matmul.cpp) reads the packed codes and looks
    each group of 8 up in a table held in registers, the outliers added as a sparse correction. Elsewhere it looks
    the dense weight up and calls the existing matmul: fewer bytes stored, not fewer read per token."""

    def __init__(self, qweight: Tensor, codebook: Tensor, bits: int, in_features: int, bias: Tensor | None = None,
                 sparse_index: Tensor | None = None, sparse_value: Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features, self.bits = qweight.shape[0], in_features, bits
        if codebook.shape[1] != 2 ** bits or self.out_features % codebook.shape[0]:
            raise ValueError(f"codebook must be (groups of rows, 2**bits = {2 ** bits}), its groups dividing "
                             f"{self.out_features} rows; got {tuple(codebook.shape)}")
        self.rows_per_codebook = self.out_features // codebook.shape[0]
        self.register_buffer("qweight", qweight.to(torch.uint8).contiguous())
        self.register_buffer("codebook", codebook.half().contiguous())
        none = torch.zeros(0)
        self.register_buffer("sparse_index", (none if sparse_index is None else sparse_index).to(torch.int32))
        self.register_buffer("sparse_value", (none if sparse_value is None else sparse_value).half())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, sensitivity: Tensor | None = None,
                    rows_per_codebook: int | None = 1, outliers: float = 0.0, max_iter: int = 100) -> CodebookLinear:
        """Cluster on the CPU (deterministic there); rows_per_codebook None: one codebook for the whole layer.
        outliers: the fraction of the layer's weights, largest |w| first, kept exactly and left out of the k-means."""
        w = linear.weight.detach().float().cpu()
        out, n_in = w.shape
        rows_per_codebook = out if rows_per_codebook is None else rows_per_codebook
        if rows_per_codebook < 1 or out % rows_per_codebook:
            raise ValueError(f"rows_per_codebook {rows_per_codebook} must divide the {out} output rows")
        wt = torch.ones_like(w) if sensitivity is None else sensitivity.float().cpu().reshape(out, n_in)
        wt = wt.clone(memory_format=torch.contiguous_format)
        sparse = w.abs().flatten().topk(round(outliers * w.numel())).indices.sort().values
        wt.view(-1)[sparse] = 0  # an outlier's own value is stored: where the centers go is none of its business
        centers, idx = kmeans_1d(w.reshape(out // rows_per_codebook, -1), 2 ** bits,
                                 wt.reshape(out // rows_per_codebook, -1), max_iter)
        bias = None if linear.bias is None else linear.bias.detach().cpu()
        return cls(pack_codes(idx.reshape(out, n_in), bits), centers, bits, n_in, bias, sparse, w.view(-1)[sparse])

    @property
    def weight_storage(self) -> Tensor:
        return self.qweight

    def codes(self) -> Tensor:
        return unpack_codes(self.qweight, self.bits, self.in_features)

    def dequantize(self) -> Tensor:
        table = self.codebook.float().repeat_interleave(self.rows_per_codebook, dim=0)
        w = table.gather(1, self.codes())
        if self.sparse_index.numel():
            w.view(-1)[self.sparse_index.long()] = self.sparse_value.float()
        return w

    def nbytes(self) -> int:
        """Bytes stored: packed indices, float16 tables, outliers (6 bytes each), bias. model_bytes counts the same."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values()) + (
            0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def bits_per_weight(self) -> float:
        return 8 * self.nbytes() / (self.out_features * self.in_features)

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.bits in (3, 4) and x.device.type == "cpu" and (kernels := cpu_kernels()) is not None:
            tables, rows, cols, delta = self._lut()
            xf = x.float()
            y = kernels.codebook_matmul(xf, self.qweight, tables, self.bits, self.in_features)
            if rows.numel():  # an outlier's weight is its kept value, not its code's: add the difference
                y.view(-1, self.out_features).index_add_(1, rows, xf.reshape(-1, self.in_features)[:, cols] * delta)
            y = y.to(x.dtype)
            return y if bias is None else y + bias
        return F.linear(x, self.dequantize().to(x.dtype), bias)

    def _lut(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(float32 tables, outliers' rows, columns, kept value minus their code's value): once, not per token, and
        again when a buffer changes (load_state_dict writes into them in place: their version counters move)."""
        key = tuple((t.data_ptr(), t._version) for t in (self.qweight, self.codebook, self.sparse_index,
                                                        self.sparse_value))
        if getattr(self, "_lut_key", None) != key:
            self._lut_key = key
            tables = self.codebook.float().contiguous()
            where = self.sparse_index.long()
            rows, cols = where // self.in_features, where % self.in_features
            code = self.codes()[rows, cols] if where.numel() else where
            looked_up = tables[rows // self.rows_per_codebook, code]
            self._lut_cache = (tables, rows, cols, self.sparse_value.float() - looked_up)
        return self._lut_cache

    def _apply(self, fn, recurse=True):  # a cast of the model leaves the float16 tables and outliers as they are
        kept = {"codebook": self.codebook, "sparse_value": self.sparse_value}
        super()._apply(fn, recurse)
        for name, t in kept.items():
            setattr(self, name, t.to(self.qweight.device))
        return self


# ------------------------------------------------------------------------------------------ the transformation

def _targets(model: nn.Module) -> dict[str, nn.Linear]:
    """The Linears fake_quantize_int4 rounds: every one but the LM head (tied to the embedding, kept in float)."""
    head = getattr(model, "lm_head", None)
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}


def fisher_diagonal(model: nn.Module, linears: dict[str, nn.Linear], calib_ids: list[int],
                    window: int = 128) -> dict[str, Tensor]:
    """Per weight: the squared gradient of each calibration window's mean next-token loss, summed over windows
    (the empirical Fisher diagonal). One forward and backward per window; only the given weights get gradients."""
    params = list(model.parameters())
    saved = [p.requires_grad for p in params]
    fisher = {name: torch.zeros_like(m.weight, dtype=torch.float32) for name, m in linears.items()}
    try:
        for p in params:
            p.requires_grad_(False)
        weights = [m.weight.requires_grad_(True) for m in linears.values()]
        with torch.inference_mode(False), torch.enable_grad():
            for start in range(0, len(calib_ids) - 1, window):
                x = torch.tensor([calib_ids[start:start + window + 1]], device=model.device)
                logits = model(x[:, :-1])[0].float()
                loss = F.cross_entropy(logits, x[0, 1:])
                for f, g in zip(fisher.values(), torch.autograd.grad(loss, weights)):
                    f.add_(g.float().pow(2))
    finally:
        for p, s in zip(params, saved):
            p.requires_grad_(s)
    return fisher


@torch.inference_mode()
def activation_second_moment(model: nn.Module, linears: dict[str, nn.Linear], calib_ids: list[int],
                             window: int = 256) -> dict[str, Tensor]:
    """Per Linear: E[x_j^2] of its input channel j over the calibration text, broadcast to the weight's shape."""
    sums: dict[str, list] = {name: [0.0, 0] for name in linears}

    def record(name, x: Tensor) -> None:
        sums[name][0] = sums[name][0] + x.pow(2).sum(0)
        sums[name][1] += x.shape[0]

    with watch_inputs(linears, record):
        run_windows(model, calib_ids, window)
    return {name: (s / n).expand_as(linears[name].weight) for name, (s, n) in sums.items()}


def codebook_quantize(model: nn.Module, bits: int = 4, sensitivity: str | None = None,
                      calib_ids: list[int] | None = None, rows_per_codebook: int | None = 1, outliers: float = 0.0,
                      max_iter: int = 100) -> nn.Module:
    """Swap the blocks' Linears (the ones fake_quantize_int4 rounds; the tied LM head stays float) for CodebookLinear,
    in place; returns the model. sensitivity: a key of SENSITIVITIES, computed on calib_ids (token ids)."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer from 1 to 8 (a codebook of 2**bits values), got {bits!r}")
    if sensitivity not in SENSITIVITIES:
        raise ValueError(f"unknown sensitivity {sensitivity!r}; choose one of {list(SENSITIVITIES)}")
    if sensitivity is not None and (calib_ids is None or len(calib_ids) < 2):
        raise ValueError(f"sensitivity={sensitivity!r} needs calib_ids (token ids), "
                         "e.g. minillm.compress.quality.calibration_ids(tokenizer, 512)")
    if not 0 <= outliers < 1:
        raise ValueError(f"outliers is the fraction of weights kept exactly, in [0, 1); got {outliers}")
    if is_quantized(model):
        raise ValueError("this model is already quantized: clustering rounded weights re-rounds them. Load a fresh "
                         "float model and quantize it once.")
    targets = _targets(model)
    for name, m in targets.items():
        if not bool(torch.isfinite(m.weight).all()):
            raise ValueError(f"{name}.weight has NaN or inf values: fix or reload the float model before clustering")
    weights = {"fisher": fisher_diagonal, "activation": activation_second_moment}.get(sensitivity)
    sens = weights(model, targets, list(calib_ids)) if weights else {}
    modules = dict(model.named_modules())
    for name, m in targets.items():
        parent, _, child = name.rpartition(".")
        layer = CodebookLinear.from_linear(m, bits, sens.get(name), rows_per_codebook, outliers, max_iter)
        setattr(modules[parent] if parent else model, child, layer.to(m.weight.device))
    model.quant_scheme = f"codebook{bits}" + (f"-{sensitivity}" if sensitivity else "")
    return model
