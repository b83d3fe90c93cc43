"""Inference metrics: bytes a decode step reads, FLOPs of prefill and decode, MBU and MFU, peak memory.

MBU (model bandwidth utilisation) = bytes the step must read / time / measured bandwidth: decode's figure of merit.
MFU (model FLOP/s utilisation) = FLOPs / time / measured peak: prefill's. Lesson 00 derives both; the roofs they
divide by come from minillm.bench.hardware. Re-exported by minillm.bench.harness.
"""

from __future__ import annotations

import resource
import sys

import torch


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a decode step reads once: parameters and persistent buffers (a quantized layer keeps its
    int8 weights and scales as buffers), a tied tensor counted once. One definition: minillm.model.model_bytes."""
    from minillm.model import model_bytes

    return model_bytes(model)


def decode_bytes_per_token(model, context_len: int, batch: int = 1) -> int:
    """Bytes a decode step must read from memory, per generated token: all weights (shared by the `batch`
    sequences of the step) plus each sequence's K and V for `context_len` cached tokens.

    This is the numerator of MBU; decode at batch 1 is memory-bound, so bytes/token / bandwidth bounds its speed.
    """
    from minillm.kv_cache import kv_bytes

    kv = kv_bytes(model.config, context_len, batch=batch, dtype=model.dtype)
    return (weight_bytes(model) + kv) // batch


def mbu(bytes_per_token: float, seconds_per_token: float, bandwidth: float) -> float:
    """Model bandwidth utilisation: achieved bytes/s over the measured bandwidth (bytes/s). 1.0 = at the roof."""
    return bytes_per_token / seconds_per_token / bandwidth


def mfu(flops: float, seconds: float, peak: float) -> float:
    """Model FLOP/s utilisation: achieved FLOP/s over the measured peak FLOP/s."""
    return flops / seconds / peak


def model_flops_per_token(cfg, context_len: int) -> int:
    """Forward FLOPs for one token that attends to `context_len` keys.

    2 FLOPs per weight per token for every matmul (the embedding lookup is no matmul; a tied LM head is), plus
    attention: q.k and p.v are 2 x 2 x n_heads x head_dim FLOPs per key per layer.
    """
    matmul_params = cfg.n_params() - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)
    attention = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * context_len
    return 2 * matmul_params + attention


def prefill_flops(cfg, n_tokens: int, logits_for: int | None = None) -> int:
    """FLOPs of a causal prefill of `n_tokens`: token i attends to i + 1 keys.

    `logits_for`: how many positions go through the LM head (default all n_tokens). A generation loop's prefill
    needs only the last one (`model(ids, last_only=True)`): with a 49,152-word vocabulary the head is a fifth of
    this model's weights, so counting it for every position would overstate the work (and MFU) by ~25%.
    """
    head = cfg.vocab_size * cfg.dim
    body = cfg.n_params() - head - (0 if cfg.tie_embeddings else head)  # minus the embedding lookup and the head
    keys = n_tokens * (n_tokens + 1) // 2
    logits_for = n_tokens if logits_for is None else logits_for
    return 2 * body * n_tokens + 2 * head * logits_for + 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * keys


def peak_memory(device: str | torch.device = "cpu") -> int:
    """Peak memory in bytes: the process's RSS high-water mark on CPU (never goes down), or the CUDA allocator's
    max_memory_allocated (reset it with torch.cuda.reset_peak_memory_stats() before the part you measure)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB, macOS bytes
