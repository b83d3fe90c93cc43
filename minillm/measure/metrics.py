"""What a run achieved, measured one way in every bench: wall time (`timer`), decode tokens/s
(`decode_rate`, of the tokens `timed_decode` times), latency percentiles (`percentiles`: one rule, linear
interpolation), a serving run's summary (`summarize`); bytes and FLOPs a step moves, MBU, MFU, peak memory.

MBU (model bandwidth utilisation) = bytes the step must read / time / measured bandwidth: decode's figure of
merit. MFU (model FLOP/s utilisation) = FLOPs / time / measured peak: prefill's. Lesson 00 derives both (the
roofs come from minillm.measure.hardware); lesson 05 the serving metrics (TTFT, TPOT, ITL, goodput).
"""

from __future__ import annotations

import math
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from itertools import pairwise

import numpy as np
import torch

# ---------------------------------------------------------------------------------------------------- timing


def _sync() -> None:
    # queued GPU kernels would otherwise finish after the clock stops
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class timer:
    """Wall seconds of a block: `with timer() as t: work()`, then `t.seconds`. CUDA's queued kernels are
    waited for at both ends when CUDA is in use, so a GPU's work counts in the block that launched it."""

    seconds: float = float("nan")

    def __enter__(self) -> timer:
        _sync()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        _sync()
        self.seconds = time.perf_counter() - self._start


def decode_rate(token_times: Sequence[float], median: bool = False) -> float:
    """Decode tokens/s from the times at which each token came out: the tokens after the first (the first
    carries the prefill) over the seconds they took, (n - 1) / (t[-1] - t[0]). median=True: 1 / the median gap
    between consecutive tokens (the upper one of an even count), which one stall of a shared machine does not
    move. NaN with fewer than two tokens."""
    if len(token_times) < 2:
        return float("nan")
    if median:
        gap = statistics.median_high(b - a for a, b in pairwise(token_times))
    else:
        gap = (token_times[-1] - token_times[0]) / (len(token_times) - 1)
    return 1 / gap if gap > 0 else float("nan")


def timed_decode(model, ids: list[int], n_new: int, cache: str = "contiguous", compile: bool = False):
    """Greedy batch-1 decode of exactly `n_new` tokens after `ids` (ignore_eos) through minillm.generate: a
    RequestOutput whose token_times (seconds from the start, CUDA synchronized per token) feed decode_rate."""
    from minillm.api import generate

    return generate(model, None, ids, max_new_tokens=n_new, cache=cache, compile=compile, ignore_eos=True)


def decode_tok_s(model, ids: list[int], n_new: int, repeat: int = 1, cache: str = "contiguous",
                 compile: bool = False) -> tuple[float, list[int]]:
    """Median decode_rate over `repeat` timed_decode runs, and the greedy ids of the first."""
    runs = [timed_decode(model, ids, n_new, cache, compile) for _ in range(repeat)]
    return statistics.median(decode_rate(r.token_times) for r in runs), runs[0].token_ids


# ----------------------------------------------------------------------------------- latency and serving runs


def percentiles(values, ps: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """{"p50": ..., "p90": ..., "p99": ...} of `values`, NaNs dropped (the TPOT of a one-token answer); NaN
    where nothing is left. One rule in every bench: linear interpolation between the two nearest ranks
    (numpy's default, method="linear"): of n sorted values, percentile p sits at rank p / 100 * (n - 1)."""
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return {f"p{p}": float("nan") for p in ps}
    return {f"p{p}": float(np.percentile(vals, p, method="linear")) for p in ps}


def summarize(outputs, wall_s: float, slo_ttft_s: float | None = None, slo_tpot_s: float | None = None,
              output_tokens: int | None = None, sent: int | None = None) -> dict:
    """Throughput, latency percentiles (seconds) and goodput of one serving run (lessons 05, 12, 13).

      throughput   output tokens/s and requests/s over the whole run
      TTFT         time to first token (queueing + prefill), per request
      TPOT         time per output token after the first: (last - first token time) / (n - 1)
      ITL          inter-token latency: every gap between consecutive tokens (its tail shows prefill stalls)
      E2E          arrival to last token
      goodput      requests/s that met a latency SLO (TTFT and TPOT bounds): the throughput users find good

    `outputs`: the requests that finished, each with .metrics: ttft, tpot, e2e (seconds) and itl (the gaps
    between its tokens), as an engine's RequestOutput has them. `output_tokens`: the tokens they generated
    (default: their .token_ids counted; a client that sees only usage counts passes it). `sent`: the requests
    sent, finished or not (default: the finished ones); slo_attained is over all of them. A request meets the
    SLO when it meets each bound given (a NaN TPOT, one token, passes)."""
    m = [o.metrics for o in outputs]
    n_tokens = sum(len(o.token_ids) for o in outputs) if output_tokens is None else output_tokens
    out = {
        "requests": len(outputs), "output_tokens": n_tokens, "wall_s": wall_s,
        "output_tok_per_s": n_tokens / wall_s, "requests_per_s": len(outputs) / wall_s,
    }
    for key in ("ttft", "tpot", "e2e"):
        for p, v in percentiles([x[key] for x in m]).items():
            out[f"{key}_{p}"] = v
    for p, v in percentiles([g for x in m for g in x["itl"]]).items():
        out[f"itl_{p}"] = v
    if slo_ttft_s is not None or slo_tpot_s is not None:
        ok = sum((slo_ttft_s is None or x["ttft"] <= slo_ttft_s) and
                 (slo_tpot_s is None or not x["tpot"] > slo_tpot_s) for x in m)
        out["goodput_req_per_s"] = ok / wall_s
        out["slo_attained"] = ok / max(len(outputs) if sent is None else sent, 1)
    return out


# ------------------------------------------------------------------------------------ bytes, FLOPs, roofs


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
