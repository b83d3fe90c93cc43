"""The paged KV cache: keys and values live in fixed-size blocks of one shared pool, found through a block table.

The contiguous cache (kv_cache.py) reserves `max_len` token slots per sequence before it knows how long the
sequence will get: most of that memory is never written (over-reservation), and a freed reservation only fits a
request no longer than it (fragmentation). Paging (vLLM's PagedAttention) cuts the pool into blocks of
`block_size` slots; a sequence takes a block only when it fills the last one, so at most `block_size - 1` slots per
sequence are wasted and any free block fits any sequence. The cost is an indirection: attention reads keys through
the sequence's block table instead of from one strided buffer. Lesson 04 measures both sides; exercise 04 asks for
the allocator and the slots (where each new token is written, where each cached token is read).

Split by job:
  KVCacheSpec / KVBlockPool  the storage (kv_pool.py): K and V blocks in `kv_dtype`, read and written by slot,
                             exported/imported as tensors (moving a request's KV between engines, lesson 13);
  BlockAllocator             which blocks are free, and their owners (block_allocator.py);
  PagedKVCache               pool + allocator, driven by the engine: the runner describes each packed forward with
                             AttentionMetadata (`set_metadata`), the model then calls begin_forward / attend;
  PagedSequenceCache         the same cache managing its own block tables for a fixed batch: what
                             `minillm.generate(..., cache="paged")` uses, like KVCache.
The attention functions it runs are in paged_attention.py; the GPU decode kernel in kernels/paged_decode.py.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor

from minillm.attention import AttentionFn, get_attention
from minillm.cache.block_allocator import BlockAllocator, OutOfBlocksError, blocks_needed
from minillm.config import ModelConfig
from minillm.cache.kv_pool import KVBlockPool, KVCacheSpec
from minillm.cache.prefix_cache import PrefixCachingAllocator
from minillm.cache.paged_attention import (  # noqa: F401
    AttentionMetadata,
    StepPlan,
    context_slots,
    gather_sequence,
    gathered_decode_attention,
    paged_attention,
    paged_prefill_attention,
)


def _triton_usable(q: Tensor, pool: KVBlockPool) -> bool:
    return q.is_cuda and not pool.spec.quantized and importlib.util.find_spec("triton") is not None


class PagedKVCache:
    """A block pool plus the allocator that hands its blocks out, attended through per-step AttentionMetadata.

    The engine drives it: `set_metadata(meta)` before each forward (the runner builds it from the schedule), then
    the model calls `begin_forward(batch=1, n_tokens, positions)` and `attend(layer_id, ...)` per layer with every
    scheduled sequence's new tokens packed in one row. Sequences with one new token take the decode path (the
    Triton kernel on CUDA; on CPU one gather through slots planned once per step and one masked SDPA), the others
    (prompts, chunks, recomputes) attend over their context with the model's dense backend, causal bottom-right."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int = 16, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", kv_dtype: torch.dtype | None = None, n_layers: int | None = None,
                 decode_backend: str = "auto", prefix_caching: bool = False):
        self.spec = KVCacheSpec(n_layers or cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, num_blocks, block_size, dtype,
                                kv_dtype)
        self.pool = KVBlockPool(self.spec, device)
        # with prefix caching, freed full blocks keep their KV and can be found by hash (lesson 12)
        self.allocator = (PrefixCachingAllocator if prefix_caching else BlockAllocator)(num_blocks, block_size)
        self.config, self.num_blocks, self.block_size = cfg, num_blocks, block_size
        # "auto": Triton on CUDA (float pools), the planned gather on CPU; or a registered "paged_decode" backend
        self.decode_backend = decode_backend
        self._meta: AttentionMetadata | None = None  # set for the next forward
        self._step: tuple[AttentionMetadata, StepPlan] | None = None  # the current forward's, planned at begin_forward

    @property
    def device(self) -> torch.device:
        return self.pool.k.device

    @property
    def k_pool(self) -> Tensor:
        return self.pool.k

    @property
    def v_pool(self) -> Tensor:
        return self.pool.v

    def bytes_per_block(self) -> int:
        return self.spec.bytes_per_block()

    def nbytes(self) -> int:
        """Bytes of the whole pool (reserved up front, like KVCache.nbytes)."""
        return self.num_blocks * self.bytes_per_block()

    def bytes_used(self) -> int:
        """Bytes of the blocks currently allocated to sequences."""
        return self.allocator.num_used() * self.bytes_per_block()

    def set_metadata(self, meta: AttentionMetadata, check: bool = True) -> None:
        """Describe the next forward's packed batch. `check` verifies, on the host lists, that every block read is
        allocated and every block written has one owner (a shared block must be copied first)."""
        if meta.block_tables.shape[0] != meta.num_seqs or meta.slot_mapping.shape != (meta.num_tokens,):
            raise ValueError(f"metadata is inconsistent: {meta.num_seqs} sequences, {meta.num_tokens} tokens, "
                             f"block_tables {tuple(meta.block_tables.shape)}, slots {tuple(meta.slot_mapping.shape)}")
        if check:
            refs = lambda b: self.allocator.ref_count(b) if 0 <= b < self.num_blocks else 0
            for i, (table, ctx, n_new) in enumerate(zip(meta.host_block_tables, meta.host_context_lens,
                                                        meta.host_query_lens)):
                read = table[: blocks_needed(ctx, self.block_size)]
                if len(read) * self.block_size < ctx or any(refs(b) == 0 for b in read):
                    raise ValueError(f"sequence {i} reads blocks {read} for {ctx} tokens: some are missing or free")
                for b in {table[p // self.block_size] for p in range(ctx - n_new, ctx)}:
                    if refs(b) != 1:
                        raise ValueError(f"writing into block {b} with ref count {refs(b)}: only a block with one "
                                         f"owner may be written (copy-on-write a shared one)")
        self._meta = meta

    def begin_forward(self, batch: int, n_new: int, positions: Tensor | None = None) -> Tensor:
        if self._meta is None:
            raise RuntimeError("no AttentionMetadata for this forward: call cache.set_metadata(meta) before each "
                               "model call")
        if positions is None:
            raise ValueError("an engine-managed PagedKVCache needs explicit positions (the runner builds them)")
        meta, self._meta = self._meta, None  # used up: the next forward must describe its own batch
        self._start_step(meta, batch * n_new)
        return positions

    def _start_step(self, meta: AttentionMetadata, n_tokens: int) -> None:
        if n_tokens != meta.num_tokens:
            raise ValueError(f"got {n_tokens} new tokens, the metadata describes {meta.num_tokens}")
        self._step = (meta, StepPlan.build(meta, self.block_size))  # which slots each layer reads: planned once

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, attn: AttentionFn) -> Tensor:
        """Write k, v to their slots, then attend q over each sequence's cached tokens.

        q (batch, n_heads, new, head_dim), k/v (batch, n_kv_heads, new, head_dim); for the engine batch is 1 and
        `new` is the packed N_total."""
        meta, plan = self._step
        batch, n_heads, n_new, head_dim = q.shape
        # (batch, heads, new, head_dim) -> (batch * new, heads, head_dim): sequence b's tokens are rows b*new ...
        q_packed = q.transpose(1, 2).reshape(-1, n_heads, head_dim)
        k_new = k.transpose(1, 2).reshape(-1, k.shape[1], head_dim)  # (N_total, n_kv_heads, head_dim)
        v_new = v.transpose(1, 2).reshape(-1, v.shape[1], head_dim)
        self.pool.write(layer_id, meta.slot_mapping, k_new, v_new)
        out = q_packed.new_empty(q_packed.shape) if plan.prefills else None
        if plan.decode_seqs:
            rows = plan.decode_rows if plan.decode_rows is not None else slice(None)
            decoded = self._decode(layer_id, q_packed[rows], meta, plan, attn)
            if out is None:  # pure decode step: no copies in or out
                out = decoded
            else:
                out[rows] = decoded
        for start, n, slots in plan.prefills:  # one attention call per prompt (chunk), causal bottom-right
            rows = slice(start, start + n)
            keys, values = (k_new[rows], v_new[rows]) if slots is None else self.pool.read(layer_id, slots)
            # (len, heads, head_dim) -> (1, heads, len, head_dim), the backend's layout
            out[rows] = attn(q_packed[rows].transpose(0, 1)[None], keys.transpose(0, 1)[None],
                             values.transpose(0, 1)[None], causal=True)[0].transpose(0, 1)
        return out.view(batch, n_new, n_heads, head_dim).transpose(1, 2)

    def _decode(self, layer_id: int, q: Tensor, meta: AttentionMetadata, plan: StepPlan, attn: AttentionFn) -> Tensor:
        """q (n, n_heads, head_dim), one query per decode sequence of the plan -> (n, n_heads, head_dim)."""
        backend = self.decode_backend
        if backend == "auto":
            backend = "triton_paged" if _triton_usable(q, self.pool) else "gather"
        if backend == "gather":
            keys, values = self.pool.read(layer_id, plan.decode_slots)  # (n, width, n_kv_heads, head_dim)
            return gathered_decode_attention(q, keys, values, plan.decode_valid, attn)
        if self.pool.spec.quantized:
            raise ValueError(f"decode backend {backend!r} reads the raw pool; an int8 pool needs 'gather' or 'auto'")
        idx = plan.decode_seqs if len(plan.decode_seqs) < meta.num_seqs else slice(None)
        host_lens = [meta.host_context_lens[i] for i in plan.decode_seqs]
        tables = meta.block_tables[idx][:, : blocks_needed(max(host_lens), self.block_size)]  # no wider than needed
        fn = get_attention(backend, kind="paged_decode")
        return fn(q, self.pool.k[layer_id], self.pool.v[layer_id], tables, meta.context_lens[idx])

    def reset(self) -> None:
        """Free every block."""
        self.allocator.reset()
        self._meta = self._step = None


class PagedSequenceCache(PagedKVCache):
    """A paged cache for a fixed batch of equal-length sequences that keeps its own block tables (generate()).

        cache = PagedSequenceCache.for_model(model, batch_size=1, max_len=prompt + new)
        model(ids, kv_cache=cache)   # blocks are allocated on demand as the sequences grow
    `block_tables_host[b]` is sequence b's block table; `truncate(n)` frees the blocks past position n."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int = 16, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", batch_size: int = 1, **kw):
        super().__init__(cfg, num_blocks, block_size, dtype, device, **kw)
        self.batch_size = batch_size
        self.block_tables_host: list[list[int]] = [[] for _ in range(batch_size)]
        self.seq_len = 0

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int, block_size: int = 16, **kw) -> PagedSequenceCache:
        """Enough blocks for `batch_size` sequences of `max_len` tokens each."""
        if max_len < 1 or batch_size < 1:
            raise ValueError(f"batch_size and max_len must be >= 1, got {batch_size}, {max_len}")
        if max_len > model.config.max_seq_len:
            raise ValueError(f"max_len {max_len} is past the model's context window ({model.config.max_seq_len})")
        num_blocks = batch_size * blocks_needed(max_len, block_size)
        return cls(model.config, num_blocks, block_size, model.dtype, model.device, batch_size=batch_size,
                   n_layers=len(model.layers), **kw)

    def begin_forward(self, batch: int, n_new: int, positions: Tensor | None = None) -> Tensor:
        if batch != self.batch_size:
            raise ValueError(f"this cache holds {self.batch_size} sequences, got a batch of {batch}")
        if positions is not None:
            pos = positions.expand(batch, n_new)
            expected = torch.arange(self.seq_len, self.seq_len + n_new, device=pos.device).expand(batch, n_new)
            if not torch.equal(pos, expected):
                raise ValueError(f"this cache holds {self.seq_len} tokens per sequence: the next positions are "
                                 f"{self.seq_len}..{self.seq_len + n_new - 1} (truncate() to go back)")
        new_len = self.seq_len + n_new
        missing = [blocks_needed(new_len, self.block_size) - len(t) for t in self.block_tables_host]
        if not self.allocator.can_allocate(sum(missing)):
            raise OutOfBlocksError(
                f"{batch} sequence(s) of {new_len} tokens need {sum(missing)} more blocks, {self.allocator.num_free()}"
                f" are free: build the cache with a larger max_len (prompt + max_new_tokens)")
        for table, n in zip(self.block_tables_host, missing):
            table += self.allocator.allocate(max(n, 0))
        self._start_step(AttentionMetadata.build(self.block_tables_host, [new_len] * batch, [n_new] * batch,
                                                 self.block_size, self.device), batch * n_new)
        start, self.seq_len = self.seq_len, new_len
        return torch.arange(start, new_len, device=self.device)

    def truncate(self, n_tokens: int) -> None:
        """Keep positions [0, n_tokens) of every sequence; blocks wholly past them go back to the pool."""
        if not 0 <= n_tokens <= self.seq_len:
            raise ValueError(f"can truncate to 0..{self.seq_len} tokens, got {n_tokens}")
        keep = blocks_needed(n_tokens, self.block_size)
        for table in self.block_tables_host:
            self.allocator.free(table[keep:])
            del table[keep:]
        self.seq_len = n_tokens

    def reset(self) -> None:
        super().reset()
        self.block_tables_host = [[] for _ in range(self.batch_size)]
        self.seq_len = 0
