"""Exercise 06: fusion and a decode step that compiles once (lesson 06, "eager -> fused -> compiled").

A batch-1 decode step is ~2,000 small ops, each paying a dispatch whatever its size. Two ways to remove them without
changing the math: fuse ops by hand (here: the residual add folded into the RMSNorm after it), and let torch.compile
trace the whole step into one generated program. The second only works if the step has the same shapes every token:
a cache that grows by one position per step makes a new graph per step (a recompile per token). gpt-fast's answer is
a static KV cache: preallocated to a fixed length, written at the token's position, attended in full under a mask.
Write both, then grade your work:

    minillm grade 06

- 06.add_norm: `add_rms_norm(x, residual, weight, eps)` returns (rms_norm(x + residual), x + residual), the sum
  formed once and normalised where it is formed, without calling an RMSNorm (yours from exercise 00, minillm's, or
  torch's): the point is one function a compiler turns into one loop.
- 06.static_cache: `StaticKVCache.begin_forward` and `StaticKVCache.attend`, the two calls every forward makes on a
  cache (the model calls begin_forward once, then attend once per layer). Shapes never depend on how many tokens are
  cached: positions travel as a tensor, and no Python number is read back from a tensor.

The graders compare add_rms_norm with the unfused computation in float64 on random shapes and dtypes (hypothesis),
values large enough that a float16 square overflows included; and the static cache with attention over a contiguous
history written token by token (prefill, chunks, decode steps, GQA, batches, a buffer full of garbage past the written
positions), then trace a decode step through it with torch.compile (fullgraph, dynamo's recompile check on): one graph
for every position, the same outputs as eager. The real-model task fuses SmolLM2-135M with your add_rms_norm (its
logits must equal the unfused model's) and decodes it through your StaticKVCache with the forward compiled once: the
eager model's greedy tokens, one graph, no recompile. Calling minillm.compile or an RMSNorm in your answers is
rejected.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: F401
from torch import Tensor

from minillm.attention import AttentionFn  # given: the attention backend's type (the static cache may ignore it)
from minillm.kv_cache import CacheFullError  # noqa: F401  given: the error a full cache raises

# task 06.add_norm -------------------------------------------------------------------------------------------


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual): the residual stream and the next sublayer's input in one function.

    x, residual (..., dim) of one float dtype; weight (dim,); eps > 0. The sum is formed once, in the inputs' dtype,
    and returned as the new residual stream (bit for bit x + residual). The normalised output is RMSNorm of that sum
    over the last dim: statistics in float32 (a float16 square overflows above ~256), eps inside the square root,
    cast back to the inputs' dtype before the multiplication by weight. Neither input is modified in place.
    Example: x = [1., 2.], residual = [2., 2.], weight = [1., 0.5], eps = 0: the sum is [3., 4.], its root mean
    square 3.5355, so the result is ([0.8485, 0.5657], [3., 4.]).
    """
    raise NotImplementedError("task 06.add_norm: see the docstring; `minillm hint 06 add_norm` for hints")


# task 06.static_cache ---------------------------------------------------------------------------------------


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
        """Start a forward of `n_new` tokens per row: decide where they go, and which slots each of them may see.

        Two callers. Eager (the prefill), positions=None: the tokens go right after the `seq_len` already cached,
        and this call advances `seq_len` by n_new; if they do not fit in max_len, raise CacheFullError (naming the
        capacity) and change nothing. Compiled (a decode step), positions given: a tensor of the tokens' positions
        (shape (n_new,) or (batch, n_new), every row at the same positions); use the last n_new of them as they are,
        and leave `seq_len` alone (the loop outside the graph counts on the host). Either way, keep for the layers'
        attend calls the (n_new,) positions and a bool mask (n_new, max_len), True where slot j is at or before the
        query's position; return the (n_new,) positions. Nothing here may depend on a number read out of
        `positions` (no .item(), int(), or slicing by it): the compiled step must trace once for every position.
        Example: max_len 8, seq_len 3, begin_forward(1, 2) places positions [3, 4], sets seq_len to 5, and the mask
        rows are slots 0..3 and 0..4; begin_forward(1, 1, torch.tensor([6])) places position 6 (mask: slots 0..6)
        and seq_len stays 5.
        """
        raise NotImplementedError("task 06.static_cache: see the docstring; `minillm hint 06 static_cache` for hints")

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, attn: AttentionFn) -> Tensor:
        """q (b, n_heads, n_new, d), k/v (b, n_kv_heads, n_new, d); attends over the whole buffer, masked.

        Writes k and v into layer `layer_id`'s buffers (self.k[layer_id], self.v[layer_id], in their dtype) at the
        positions begin_forward placed (dim 2, the slot axis), then returns softmax(q k^T / sqrt(d)) v over all
        max_len slots of that layer with begin_forward's mask, (b, n_heads, n_new, d) in q's dtype. Query head h
        reads KV head h // (n_heads / n_kv_heads). Slots the mask hides may hold anything (stale keys of a truncated
        sequence, zeros): they must not change the result. The shapes of every tensor are the same at every
        position, so one traced graph serves the whole decode. `attn` (the model's attention backend) may be
        ignored: a masked torch attention over the buffer is what this cache is for. Example: positions [3, 4] of
        a prefill chunk after 3 cached tokens: the query at 3 attends slots 0..3, the one at 4 slots 0..4, both
        reading the keys just written at slots 3 and 4; slots 5..max_len - 1 never count.
        """
        raise NotImplementedError("task 06.static_cache: see the docstring; `minillm hint 06 static_cache` for hints")

    def truncate(self, n_tokens: int) -> None:
        """Forget positions from n_tokens on: the mask hides them until they are written again."""
        if not 0 <= n_tokens <= self.seq_len:
            raise ValueError(f"can truncate to 0..{self.seq_len} tokens, got {n_tokens}")
        self.seq_len = n_tokens
