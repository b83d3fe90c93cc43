"""torch.compile for decode: one generated program per step instead of thousands of small ops (lesson 06).

Dynamo traces the decode step, inductor generates fused code for it (C++ loops on a CPU, Triton on a GPU; on
CUDA, mode="reduce-overhead" also replays the step as a CUDA graph). A step whose shapes grow with the context
would recompile every token, so `StaticKVCache` (gpt-fast's answer) preallocates a power-of-two length
(`static_length`), writes at the token's position and attends over the whole buffer with a mask: one compile,
then zero recompiles. `compiled_decode` builds the step, `decode_tokens_compiled` runs the loop.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
import shutil

import torch
import torch.nn.functional as F
from minillm_kernels import triton_available
from torch import Tensor

from minillm.attention import AttentionFn
from minillm.kv_cache import CacheFullError
from minillm.request import Request
from minillm.sampling import sample_from_logits



def static_length(n_tokens: int, minimum: int = 256) -> int:
    """The cache length for n_tokens: the next power of two (>= minimum), so lengths share compiled code."""
    return max(minimum, 1 << (max(n_tokens, 1) - 1).bit_length())


class StaticKVCache:
    """A contiguous cache with fixed shapes for compiled decoding: (n_layers, batch, n_kv_heads, max_len, head_dim).

    Positions are tensors end to end (no Python int derived from data), so `begin_forward` and `attend` trace into
    the graph: write k/v at `positions`, attend over all max_len slots with a mask of the keys at or before each
    query. `seq_len` is the host's count, advanced outside the compiled region by whoever drives the loop."""

    def __init__(self, cfg, batch_size: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", n_layers: int | None = None):
        if max_len > cfg.max_seq_len:
            raise ValueError(f"max_len {max_len} is past the model's context window ({cfg.max_seq_len})")
        shape = (n_layers or cfg.n_layers, batch_size, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.batch_size, self.max_len, self.seq_len = batch_size, max_len, 0
        self._positions: Tensor | None = None
        self._mask: Tensor | None = None

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int) -> StaticKVCache:
        return cls(model.config, batch_size, max_len, model.dtype, model.device, n_layers=len(model.layers))

    def begin_forward(self, batch: int, n_new: int, positions: Tensor | None = None) -> Tensor:
        if positions is None:  # eager use (prefill): place after what is cached, on the host
            if self.seq_len + n_new > self.max_len:
                raise CacheFullError(f"StaticKVCache holds {self.max_len} tokens; {self.seq_len} + {n_new} do not fit")
            positions = torch.arange(self.seq_len, self.seq_len + n_new, device=self.k.device)
            self.seq_len += n_new
        positions = positions.reshape(-1)[-n_new:]  # (n_new,): every row of the batch is at the same positions
        self._positions = positions
        # (n_new, max_len): query at position p sees the slots 0..p
        self._mask = torch.arange(self.max_len, device=positions.device)[None, :] <= positions[:, None]
        return positions

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, attn: AttentionFn) -> Tensor:
        """q (b, n_heads, n_new, d), k/v (b, n_kv_heads, n_new, d); attends over the whole buffer, masked."""
        k_all, v_all = self.k[layer_id], self.v[layer_id]
        k_all.index_copy_(2, self._positions, k.to(k_all.dtype))
        v_all.index_copy_(2, self._positions, v.to(v_all.dtype))
        b, n_heads, n_new, d = q.shape
        group = n_heads // k_all.shape[1]
        if n_new == 1:  # decode: the query heads of a group become rows, so each KV head is read once (sdpa_attention)
            out = F.scaled_dot_product_attention(q.reshape(b, k_all.shape[1], group, d), k_all, v_all,
                                                 attn_mask=self._mask)
            return out.reshape(b, n_heads, 1, d)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=self._mask, enable_gqa=group > 1)

    def truncate(self, n_tokens: int) -> None:
        """Forget positions from n_tokens on: the mask hides them until they are written again."""
        if not 0 <= n_tokens <= self.seq_len:
            raise ValueError(f"can truncate to 0..{self.seq_len} tokens, got {n_tokens}")
        self.seq_len = n_tokens


def compiler_available(device: torch.device) -> str | None:
    """None if torch.compile can generate code for `device` here, else the reason it cannot."""
    if device.type == "cpu" and not (shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
                                     or shutil.which("clang++")):
        return "inductor needs a C++ compiler on the CPU and none was found (install g++, or set CXX)"
    if device.type == "cuda" and not triton_available():
        return "inductor needs triton on CUDA (pip install triton)"
    return None


def compiled_decode(model, mode: str | None = None):
    """The model's forward compiled for decode steps (cached on the model): fullgraph, so a graph break is an error
    here rather than a silent slowdown. mode defaults to "reduce-overhead" (CUDA graphs) on CUDA, "default" on CPU.
    Raises RuntimeError with the reason when the compiler cannot work on this machine."""
    key = mode or ("reduce-overhead" if model.device.type == "cuda" else "default")
    cached = model.__dict__.setdefault("_compiled_decode", {})  # mode -> (id of the model it was built for, function)
    if key not in cached or cached[key][0] != id(model):  # a deepcopy shares the functions of the original: rebuild
        reason = compiler_available(model.device)
        if reason:
            raise RuntimeError(f"compile=True: {reason}; or run without compile")
        # inductor caches generated code on disk (FX graph cache): the second process skips most of the compile
        torch._inductor.config.fx_graph_cache = True
        cached[key] = (id(model), torch.compile(model.forward, mode=key, fullgraph=True, dynamic=False))
    return cached[key][1]


@torch.inference_mode()
def decode_tokens_compiled(model, req: Request) -> Iterator[int]:
    """decode_tokens (minillm/decode_loop.py) with every decode step through the compiled forward: the prompt prefills
    eagerly into a StaticKVCache, then each step has the same shapes (position as a tensor, the host counts). The
    first call compiles (seconds); later calls with the same cache length reuse it."""
    params, ids = req.params, req.prompt_ids
    kv = StaticKVCache.for_model(model, 1, min(static_length(len(ids) + params.max_tokens), model.config.max_seq_len))
    step = compiled_decode(model)
    step_input = torch.tensor([ids], dtype=torch.long, device=model.device)
    for i in range(params.max_tokens):
        if i == 0:
            logits = model(step_input, kv_cache=kv, last_only=True)[:, -1]
        else:
            positions = torch.tensor([kv.seq_len], device=model.device)
            logits = step(step_input, positions=positions, kv_cache=kv, last_only=True)[:, -1]
            kv.seq_len += 1
        token = sample_from_logits(logits, params.temperature, params.top_k, params.top_p, req.generator)  # (1,)
        tok = int(token)
        yield tok
        if tok in req.stop_ids:
            return
        step_input = token[:, None]
