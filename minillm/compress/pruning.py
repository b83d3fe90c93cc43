"""Structured pruning: remove whole blocks, KV groups and FFN channels, for a smaller dense model (lesson 08).

Zeros inside a dense matrix save nothing (sparsity.py); removed rows and columns do, on any hardware, and every
path (generate, the engine, the paged cache) runs the result unchanged: its config says what it now is. Each unit
has an importance measured on calibration text: `block_importance` (1 - cos(input, output), ShortGPT's block
influence), `kv_group_importance` (a KV head with its query heads), `ffn_channel_importance` (mean |activation| x
the norm of down's column, after Wanda). `prune_structured` applies all three; lesson 09 distils the result.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from minillm.compress.calibration import calib_batch, watch_inputs
from minillm.model import Transformer


def _check_float_unfused(model: Transformer) -> None:
    block = model.layers[0]
    if not (hasattr(block.attn, "wq") and hasattr(block.mlp, "gate")):
        raise ValueError("structured pruning slices wq/wk/wv/wo and gate/up/down: prune an unfused model "
                         "(load_model(..., fuse=False)), then fuse it")
    if not all(isinstance(m, nn.Linear) for m in (block.attn.wq, block.mlp.down)):
        raise ValueError("prune a float model, then quantize it: quantized layers cannot be sliced")


def _check_importance(importance: Tensor, what: str) -> None:
    if not torch.isfinite(importance).all():
        raise ValueError(f"{what} importance contains NaN or inf: the calibration forward overflowed or produced "
                         "NaN (run it in float32, and check the model's output on the calibration text)")


def n_params(model: nn.Module) -> int:
    """Parameters, each storage once (the tied LM head is the embedding)."""
    return sum(p.numel() for p in {p.data_ptr(): p for p in model.parameters()}.values())


# ------------------------------------------------------------------------------------------------- blocks


@torch.inference_mode()
def block_importance(model: Transformer, calib_ids: list[int], window: int = 256) -> Tensor:
    """(n_layers,): 1 - mean cosine similarity between each block's input and output hidden states."""
    x = calib_batch(model, calib_ids, window)
    outs: list[Tensor] = []
    h0 = model.embed_tokens(x)
    model.run_layers(h0, torch.arange(x.shape[1], device=x.device).expand_as(x), hidden_states=outs)
    ins = [h0] + outs[:-1]
    cos = torch.stack([torch.cosine_similarity(a.float(), b.float(), dim=-1).mean() for a, b in zip(ins, outs)])
    importance = 1 - cos
    _check_importance(importance, "block")
    return importance


def drop_blocks(model: Transformer, drop: list[int]) -> Transformer:
    """Remove blocks `drop` (indices into model.layers) in place; the config's n_layers follows."""
    n = len(model.layers)
    bad = [i for i in drop if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n]
    if bad:
        raise ValueError(f"block indices must be in 0..{n - 1}, got {bad}")
    if len(set(drop)) != len(drop):
        raise ValueError(f"duplicate block indices in {sorted(drop)}")
    if len(drop) >= n:
        raise ValueError(f"cannot drop all {n} blocks: keep at least one")
    model.layers = nn.ModuleList(b for i, b in enumerate(model.layers) if i not in set(drop))
    model.config = model.config.with_(n_layers=len(model.layers))
    return model


def least_important(importance: Tensor, k: int) -> list[int]:
    """The k indices of lowest importance, in ascending index order."""
    if not 0 <= k <= importance.numel():
        raise ValueError(f"cannot pick {k} of {importance.numel()}")
    return sorted(torch.argsort(importance, stable=True)[:k].tolist())


@torch.inference_mode()
def greedy_block_drop(model: Transformer, x: Tensor, k: int, mask: Tensor | None = None) -> list[int]:
    """The k blocks to drop, chosen one at a time: each round removes the block whose removal costs the least
    KL(model || pruned) on x (batch, seq), at the positions of `mask` (batch, seq; None: all), given the blocks
    already removed. Returns them in the order removed.

    Why not the k least important by `block_importance`: each score is measured with every other block in place,
    so removing several at once compounds errors the scores never saw (on SmolLM2, dropping 14 of 30 that way
    starts a student at perplexity ~36,600; this greedy choice, scored on chat answers, at ~225; lesson 09).
    A round re-runs only the blocks after the candidate: the hidden states before it are shared."""
    _check_float_unfused(model)
    n = len(model.layers)
    if not 0 <= k < n:
        raise ValueError(f"can drop 0..{n - 1} of {n} blocks, got k={k}")
    if x.dim() != 2:
        raise ValueError(f"x must be (batch, seq) token ids, got shape {tuple(x.shape)}")
    mask = torch.ones_like(x, dtype=torch.bool) if mask is None else mask.to(x.device)
    if mask.shape != x.shape or not mask.any():
        raise ValueError(f"mask must be a (batch, seq) = {tuple(x.shape)} bool tensor with some True")
    pos = torch.arange(x.shape[1], device=x.device).expand_as(x)
    cos, sin = model.rope_cos[pos][:, None], model.rope_sin[pos][:, None]
    h0 = model.embed_tokens(x)
    ref = torch.log_softmax(model.logits(model.run_layers(h0, pos)[mask][None])[0].float(), -1)

    def cost(h: Tensor, blocks: list[int]) -> float:
        for i in blocks:
            h = model.layers[i](h, cos, sin, model._attn, i, None)
        logp = torch.log_softmax(model.logits(h[mask][None])[0].float(), -1)
        return float(torch.nn.functional.kl_div(logp, ref, log_target=True, reduction="batchmean"))

    keep, order = list(range(n)), []
    for _ in range(k):
        hs = [h0]
        for i in keep:
            hs.append(model.layers[i](hs[-1], cos, sin, model._attn, i, None))
        costs = [cost(hs[j], keep[j + 1:]) for j in range(len(keep))]  # hs[j] is block keep[j]'s input
        drop = keep[min(range(len(keep)), key=costs.__getitem__)]
        keep.remove(drop)
        order.append(drop)
    return order


# --------------------------------------------------------------------------------------- heads (KV groups)


@torch.inference_mode()
def kv_group_importance(model: Transformer, calib_ids: list[int], window: int = 256) -> Tensor:
    """(n_layers, n_kv_heads): mean L2 norm per token of each KV group's contribution to the attention output."""
    _check_float_unfused(model)
    cfg = model.config
    hd, per_group = cfg.head_dim, cfg.group_size
    scores = torch.zeros(len(model.layers), cfg.n_kv_heads)
    wos = {i: block.attn.wo for i, block in enumerate(model.layers)}

    def record(i: int, x: Tensor) -> None:
        o = x.reshape(-1, cfg.n_heads, hd)  # (tokens, heads, head_dim)
        w = wos[i].weight.float().reshape(wos[i].weight.shape[0], cfg.n_heads, hd)  # (dim, heads, head_dim)
        contrib = torch.einsum("thd,ohd->tho", o, w)  # each head's share of the output
        group = contrib.reshape(o.shape[0], cfg.n_kv_heads, per_group, -1).sum(2)  # (tokens, groups, dim)
        scores[i] += group.norm(dim=-1).mean(0).cpu()

    with watch_inputs(wos, record):
        model(calib_batch(model, calib_ids, window))
    _check_importance(scores, "KV group")
    return scores


def _sliced(lin: nn.Linear, rows: Tensor | None = None, cols: Tensor | None = None) -> nn.Linear:
    w = lin.weight.detach()
    if rows is not None:
        w = w[rows]
    if cols is not None:
        w = w[:, cols]
    new = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    new.weight = nn.Parameter(w.contiguous(), requires_grad=False)
    return new


def prune_kv_groups(model: Transformer, keep: int, importance: Tensor) -> Transformer:
    """Keep the `keep` most important KV groups of every block (a KV head and its query heads), in place."""
    _check_float_unfused(model)
    cfg = model.config
    if not isinstance(keep, int) or not 1 <= keep <= cfg.n_kv_heads:
        raise ValueError(f"keep must be a whole number of KV groups in 1..{cfg.n_kv_heads} (each group is one KV "
                         f"head and its {cfg.group_size} query heads), got {keep!r}")
    if importance.shape != (len(model.layers), cfg.n_kv_heads):
        raise ValueError(f"importance must be (n_layers, n_kv_heads) = ({len(model.layers)}, {cfg.n_kv_heads}), "
                         f"got {tuple(importance.shape)}")
    _check_importance(importance, "KV group")
    hd, g = cfg.head_dim, cfg.group_size
    for block, imp in zip(model.layers, importance):
        groups = torch.sort(torch.argsort(imp, descending=True, stable=True)[:keep]).values
        kv_rows = (groups[:, None] * hd + torch.arange(hd)).flatten()
        q_heads = (groups[:, None] * g + torch.arange(g)).flatten()  # query head h reads KV head h // g
        q_rows = (q_heads[:, None] * hd + torch.arange(hd)).flatten()
        a = block.attn
        a.wq, a.wk, a.wv = _sliced(a.wq, q_rows), _sliced(a.wk, kv_rows), _sliced(a.wv, kv_rows)
        a.wo = _sliced(a.wo, cols=q_rows)
        a.n_heads, a.n_kv_heads = keep * g, keep
    # the same count in every block, so that one ModelConfig still describes every block
    model.config = cfg.with_(n_heads=keep * g, n_kv_heads=keep, head_dim=hd)
    return model


# ----------------------------------------------------------------------------------------------- FFN channels


@torch.inference_mode()
def ffn_channel_importance(model: Transformer, calib_ids: list[int], window: int = 256) -> Tensor:
    """(n_layers, ffn_dim): mean |silu(gate) * up| per channel times the norm of down's column for it."""
    _check_float_unfused(model)
    scores = torch.zeros(len(model.layers), model.config.ffn_dim)
    counts = [0] * len(model.layers)

    def record(i: int, a: Tensor) -> None:
        scores[i] += a.abs().sum(0).cpu()
        counts[i] += a.shape[0]

    with watch_inputs({i: block.mlp.down for i, block in enumerate(model.layers)}, record):
        model(calib_batch(model, calib_ids, window))
    col_norm = torch.stack([b.mlp.down.weight.float().norm(dim=0).cpu() for b in model.layers])
    scores = scores / torch.tensor(counts)[:, None] * col_norm
    _check_importance(scores, "FFN channel")
    return scores


def prune_ffn_channels(model: Transformer, keep: int, importance: Tensor) -> Transformer:
    """Keep the `keep` most important SwiGLU channels of every block, in place; config.ffn_dim = keep."""
    _check_float_unfused(model)
    cfg = model.config
    if not isinstance(keep, int) or not 1 <= keep <= cfg.ffn_dim:
        raise ValueError(f"keep must be a number of FFN channels in 1..{cfg.ffn_dim}, got {keep!r}")
    if importance.shape != (len(model.layers), cfg.ffn_dim):
        raise ValueError(f"importance must be (n_layers, ffn_dim) = ({len(model.layers)}, {cfg.ffn_dim}), "
                         f"got {tuple(importance.shape)}")
    _check_importance(importance, "FFN channel")
    for block, imp in zip(model.layers, importance):
        ch = torch.sort(torch.argsort(imp, descending=True, stable=True)[:keep]).values
        m = block.mlp
        m.gate, m.up, m.down = _sliced(m.gate, ch), _sliced(m.up, ch), _sliced(m.down, cols=ch)
    model.config = cfg.with_(ffn_dim=keep)  # the same width in every block: one ModelConfig for all
    return model


# ------------------------------------------------------------------------------------------------- all three


def prune_structured(model: Transformer, calib_ids: list[int], drop_n_blocks: int = 0, kv_groups: int | None = None,
                     ffn_dim: int | None = None, window: int = 256) -> dict:
    """Drop the `drop_n_blocks` least important blocks, then keep `kv_groups` KV groups and `ffn_dim` channels per
    block (None: leave as is). Importances are measured on the model as it stands before each step. In place;
    returns a report: what was removed and the parameter counts."""
    before = n_params(model)
    report: dict = {"params_before": before}
    if drop_n_blocks:
        imp = block_importance(model, calib_ids, window)
        report["dropped_blocks"] = least_important(imp, drop_n_blocks)
        report["block_importance"] = [round(float(v), 5) for v in imp]
        drop_blocks(model, report["dropped_blocks"])
    if kv_groups is not None and kv_groups != model.config.n_kv_heads:
        prune_kv_groups(model, kv_groups, kv_group_importance(model, calib_ids, window))
        report["kv_groups"] = kv_groups
    if ffn_dim is not None and ffn_dim != model.config.ffn_dim:
        prune_ffn_channels(model, ffn_dim, ffn_channel_importance(model, calib_ids, window))
        report["ffn_dim"] = ffn_dim
    report["params_after"] = n_params(model)
    report["params_removed"] = 1 - report["params_after"] / before
    return report
