"""The paged KV cache (lesson 04): keys and values in fixed-size blocks of one pool, read via block tables.

A contiguous cache reserves max_len slots per sequence up front; paging (vLLM's PagedAttention) hands out a block
only when the last one fills: a sequence wastes at most block_size - 1 slots, any free block fits.
  PagedKVCache        the pool (kv_pool.py), allocator (block_allocator.py) and attention (paged_attention.py);
  PagedSequenceCache  the same cache keeping its own BlockTables for a fixed batch (generate(cache="paged"));
  PackedForward       the model over several sequences' new tokens packed in one row (engine runner, drafter).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from minillm_kernels import cpu_lowbit, triton_available
from torch import Tensor

from minillm.attention import AttentionFn, get_attention
from minillm.cache.block_allocator import BlockAllocator, BlockTable, OutOfBlocksError, blocks_needed
from minillm.cache.kv_pool import KVBlockPool, KVCacheSpec
from minillm.cache.paged_attention import AttentionMetadata, StepPlan, gathered_decode_attention
from minillm.config import ModelConfig


def _triton_usable(q: Tensor, pool: KVBlockPool) -> bool:
    return q.is_cuda and not pool.spec.quantized and triton_available()


def _int8_cpu_decode_usable(q: Tensor, pool: KVBlockPool) -> bool:
    """An int8 pool on the CPU with the CPU kernels built (cpu_lowbit.load(): cached, MINILLM_CPU_KERNELS=off says
    no); not while torch.compile traces (dynamo cannot see into the C++ call: the gather path then)."""
    return (pool.spec.quantized and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and not torch.compiler.is_compiling() and cpu_lowbit.load() is not None)


class PagedKVCache:
    """A block pool plus the allocator that hands its blocks out, attended through per-step AttentionMetadata.

    The engine drives it: `set_metadata(meta)` before each forward (the runner builds it from the schedule), then
    the model calls `begin_forward(batch=1, n_tokens, positions)` and `attend(layer_id, ...)` per layer with every
    scheduled sequence's new tokens packed in one row. Sequences with one new token take the decode path (the
    Triton kernel on CUDA; on CPU one gather through slots planned once per step and one masked SDPA), the others
    (prompts, chunks, recomputes) attend over their context with the model's dense backend, causal bottom-right."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int = 16, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", kv_dtype: torch.dtype | None = None, n_layers: int | None = None,
                 decode_backend: str = "auto", allocator: BlockAllocator | None = None):
        self.spec = KVCacheSpec(n_layers or cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, num_blocks, block_size, dtype,
                                kv_dtype)
        self.pool = KVBlockPool(self.spec, device)
        # who owns which block: the engine hands in the allocator its BlockManager shares (with prefix
        # caching a PrefixCachingAllocator, lesson 12); a cache built without one makes a plain one
        self.allocator = BlockAllocator(num_blocks, block_size) if allocator is None else allocator
        if (self.allocator.num_blocks, self.allocator.block_size) != (num_blocks, block_size):
            raise ValueError(f"the allocator hands out {self.allocator.num_blocks} blocks of "
                             f"{self.allocator.block_size} tokens, the pool has {num_blocks} of {block_size}")
        self.config, self.num_blocks, self.block_size = cfg, num_blocks, block_size
        # "auto": Triton on CUDA (float pools), the fused int8 kernel on CPU (int8 pools), else the planned gather;
        # or "gather", or a registered "paged_decode" backend
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
        idx = plan.decode_seqs if len(plan.decode_seqs) < meta.num_seqs else slice(None)
        if backend == "auto" and _int8_cpu_decode_usable(q, self.pool):
            # An int8 pool through "gather" costs more than a float32 one: KVBlockPool.read gathers the codes and the
            # scales, widens and multiplies -- several full-size float copies of every context per layer -- before
            # attention reads them again, so int8 lost to float32 despite 4x fewer bytes. The fused CPU kernel
            # (kernels/cpu/int8_kv_attention.cpp) reads each int8 row and its scale once, straight from the blocks.
            pool = self.pool
            return cpu_lowbit.paged_int8_decode(q, pool.k[layer_id], pool.k_scale[layer_id], pool.v[layer_id],
                                                pool.v_scale[layer_id], meta.block_tables[idx], meta.context_lens[idx],
                                                q.shape[-1] ** -0.5)
        if backend == "auto":
            backend = "triton_paged" if _triton_usable(q, self.pool) else "gather"
        if backend == "gather":  # also the explicit choice for an int8 pool: torch's gather, the kernel's reference
            keys, values = self.pool.read(layer_id, plan.decode_slots)  # (n, width, n_kv_heads, head_dim)
            return gathered_decode_attention(q, keys, values, plan.decode_valid, attn)
        if self.pool.spec.quantized:
            raise ValueError(f"decode backend {backend!r} reads the raw pool; an int8 pool needs 'gather' or 'auto'")
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
    `tables[b]` is sequence b's BlockTable (`block_tables_host[b]` its ids); `truncate(n)` frees the
    blocks past position n."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int = 16, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", batch_size: int = 1, **kw):
        super().__init__(cfg, num_blocks, block_size, dtype, device, **kw)
        self.batch_size = batch_size
        self.tables = [BlockTable(self.allocator) for _ in range(batch_size)]
        self.seq_len = 0

    @property
    def block_tables_host(self) -> list[list[int]]:
        return [t.block_ids for t in self.tables]

    @block_tables_host.setter
    def block_tables_host(self, tables: list[list[int]]) -> None:
        self.tables = [BlockTable(self.allocator, ids) for ids in tables]

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
        missing = sum(t.missing(new_len) for t in self.tables)
        if not self.allocator.can_allocate(missing):  # all sequences or none
            raise OutOfBlocksError(
                f"{batch} sequence(s) of {new_len} tokens need {missing} more blocks, "
                f"{self.allocator.num_free()} are free: build the cache with a larger max_len (prompt + "
                f"max_new_tokens)")
        for table in self.tables:
            table.grow(new_len)
        self._start_step(AttentionMetadata.build(self.block_tables_host, [new_len] * batch, [n_new] * batch,
                                                 self.block_size, self.device), batch * n_new)
        start, self.seq_len = self.seq_len, new_len
        return torch.arange(start, new_len, device=self.device)

    def truncate(self, n_tokens: int) -> None:
        """Keep positions [0, n_tokens) of every sequence; blocks wholly past them go back to the pool."""
        if not 0 <= n_tokens <= self.seq_len:
            raise ValueError(f"can truncate to 0..{self.seq_len} tokens, got {n_tokens}")
        for table in self.tables:
            table.truncate(n_tokens)
        self.seq_len = n_tokens

    def reset(self) -> None:
        super().reset()
        self.tables = [BlockTable(self.allocator) for _ in range(self.batch_size)]
        self.seq_len = 0


class Chunk(NamedTuple):
    """One sequence's share of a packed forward: `tokens` at positions start, start + 1, ... of the sequence
    whose keys and values live in `block_table` (which covers them); logits come back at its last
    `num_logits` tokens."""

    block_table: list[int]
    start: int
    tokens: list[int]
    num_logits: int = 1


class PackedForward:
    """Run a model over several sequences' new tokens packed in one row (1, N_total) through a PagedKVCache.

    Prompts, chunks, decodes and drafts go in one forward, unpadded: AttentionMetadata tells the cache each
    token's slot and each sequence's context. Only the rows asked for reach the LM head. Token ids and
    positions are copied into buffers allocated once, so the model always reads the same storage (lesson 06).
    """

    def __init__(self, model, cache: PagedKVCache, max_tokens: int = 512, check_metadata: bool = False):
        self.model, self.cache, self.check_metadata = model, cache, check_metadata
        self._ids = torch.zeros(max_tokens, dtype=torch.long, device=model.device)
        self._positions = torch.zeros(max_tokens, dtype=torch.long, device=model.device)

    def _fill(self, name: str, values: list[int]) -> Tensor:
        buf = getattr(self, name)
        if len(values) > buf.numel():  # longer than planned (static baseline, a draft's prompt): grow once
            buf = torch.zeros(len(values), dtype=buf.dtype, device=buf.device)
            setattr(self, name, buf)
        view = buf[: len(values)]
        view.copy_(torch.tensor(values, dtype=buf.dtype), non_blocking=True)
        return view

    def __call__(self, chunks: list[Chunk]) -> Tensor:
        """Logits (rows, vocab): each chunk's last num_logits rows, chunk after chunk."""
        ids: list[int] = []
        positions: list[int] = []
        tables, context_lens, query_lens, rows = [], [], [], []
        for c in chunks:
            ids += c.tokens
            positions += range(c.start, c.start + len(c.tokens))
            tables.append(c.block_table)
            context_lens.append(c.start + len(c.tokens))  # cached after this forward, the new ones included
            query_lens.append(len(c.tokens))
            rows += range(len(ids) - c.num_logits, len(ids))
        device = self.model.device
        meta = AttentionMetadata.build(tables, context_lens, query_lens, self.cache.block_size, device)
        self.cache.set_metadata(meta, check=self.check_metadata)
        input_ids, pos = self._fill("_ids", ids)[None], self._fill("_positions", positions)[None]
        rows_t = torch.tensor(rows, dtype=torch.long, device=device)
        return self.model(input_ids, positions=pos, kv_cache=self.cache, logits_at=rows_t)[0]
