"""The paged KV cache: keys and values live in fixed-size blocks of one shared pool, found through a block table.

The contiguous cache (kv_cache.py) reserves `max_len` token slots per sequence before it knows how long the
sequence will get: most of that memory is never written (over-reservation), and a freed reservation only fits a
request no longer than it (fragmentation). Paging (vLLM's PagedAttention) cuts the pool into blocks of
`block_size` slots; a sequence takes a block only when it fills the last one, so at most `block_size - 1` slots per
sequence are wasted and any free block fits any sequence. The cost is an indirection: attention reads keys through
the sequence's block table instead of from one strided buffer. Lesson 04 measures both sides; exercise 04 asks for
the allocator and the gather. Bookkeeping is in block_allocator.py, the GPU kernel in kernels/paged_decode.py.

Layout (chosen so a new token is one row write and a block is one (block_size, n_kv_heads, head_dim) tile):
    k_pool, v_pool: (n_layers, num_blocks, block_size, n_kv_heads, head_dim)
    slot = block_id * block_size + offset   indexes k_pool[layer].view(num_blocks * block_size, n_kv_heads, head_dim)
    token at position p of a sequence with block table T lives in slot T[p // block_size] * block_size + p % block_size

Two ways to drive it (both implement minillm.model.KVCacheLike):

1. Self-managed, like KVCache (what `minillm.generate(..., cache="paged")` uses):
       cache = PagedKVCache.for_model(model, batch_size=1, max_len=prompt + new)
       model(ids, kv_cache=cache)  # seq_len/attend/advance behave like KVCache; blocks are allocated on demand
   `cache.block_tables_host[b]` is sequence b's block table.

2. Engine-managed (minillm.engine): the scheduler owns sequences and calls `cache.allocator` itself; the model
   runner packs every scheduled sequence's new tokens into one row and describes the batch with AttentionMetadata:
       meta = AttentionMetadata.build(block_tables=[[3, 7], [1]], context_lens=[20, 5], query_lens=[1, 5],
                                      block_size=cache.block_size, device=cache.device)
       cache.set_metadata(meta)   # once per forward; checks the slots written belong to allocated, unshared blocks
       logits = model(input_ids, positions=positions, kv_cache=cache)   # input_ids, positions: (1, N_total)
   context_lens count the cached tokens *including* this step's new ones; a sequence's query_lens new tokens are
   its last positions (so prefill, chunked prefill, recompute after preemption and decode all fit). In that mode
   `attend` gets q (1, n_heads, N_total, head_dim), k/v (1, n_kv_heads, N_total, head_dim) and returns
   (1, n_heads, N_total, head_dim); `advance` only marks the metadata used, and `seq_len` raises (pass positions).

Inside `attend`: new k/v are written to their slots (slot_mapping), then sequences with one new token take the
decode fast path and the others (prefill) attend over their context with the model's attention backend, causal
bottom-right (a prompt with nothing cached yet attends over its own new k/v directly: no gather needed).
The decode fast path is the Triton kernel on CUDA; on CPU it gathers through the block tables into a padded
(num_seqs, n_kv_heads, longest, head_dim) tensor and runs fused SDPA with a key-padding mask
(`gathered_decode_attention`).
Which pool slots to gather is the same for all layers of a forward, so `context_slots` turns the block tables into
flat slot indices once per forward (`StepPlan`) and every layer reuses them: per layer that is one index_select for
the keys, one for the values, one SDPA call. `paged_attention` (exercise 04) is the readable reference of the same
gather; it upcasts and masks in separate passes, which makes it a few times slower per layer on CPU.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import AttentionFn, sdpa_attention
from .block_allocator import BlockAllocator, OutOfBlocksError, blocks_needed
from .config import ModelConfig

__all__ = ["AttentionMetadata", "BlockAllocator", "OutOfBlocksError", "PagedKVCache", "StepPlan", "blocks_needed",
           "context_slots", "gathered_decode_attention", "paged_attention", "paged_prefill_attention"]


@dataclass
class AttentionMetadata:
    """Where one packed forward's tokens go and what each sequence attends over (built by the engine's runner)."""

    block_tables: Tensor  # (num_seqs, max_blocks) int32, row i = sequence i's block ids, padded with -1
    context_lens: Tensor  # (num_seqs,) int32: tokens cached per sequence after this step (new ones included)
    cu_seqlens_q: Tensor  # (num_seqs + 1,) int32: sequence i's new tokens are packed rows cu[i] .. cu[i+1]-1
    slot_mapping: Tensor  # (N_total,) int64: pool slot of each new token
    host_query_lens: list[int]  # the same numbers on the host, so attend can split decode/prefill without a sync
    host_context_lens: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.host_query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.host_query_lens)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.host_query_lens)

    @classmethod
    def build(cls, block_tables: list[list[int]], context_lens: list[int], query_lens: list[int], block_size: int,
              device: torch.device | str = "cpu") -> AttentionMetadata:
        """Tensors from plain lists. Sequence i's query_lens[i] new tokens are positions
        context_lens[i] - query_lens[i] .. context_lens[i] - 1; its block table must cover context_lens[i]."""
        if not (len(block_tables) == len(context_lens) == len(query_lens)) or not block_tables:
            raise ValueError(f"need one block table, context length and query length per sequence, got "
                             f"{len(block_tables)}, {len(context_lens)}, {len(query_lens)}")
        slots: list[int] = []
        for i, (table, ctx, n_new) in enumerate(zip(block_tables, context_lens, query_lens)):
            if not 1 <= n_new <= ctx:
                raise ValueError(f"sequence {i}: need 1 <= query_len <= context_len, got {n_new}, {ctx}")
            if len(table) < blocks_needed(ctx, block_size) or any(b < 0 for b in table):
                raise ValueError(f"sequence {i}: {ctx} tokens need {blocks_needed(ctx, block_size)} blocks of "
                                 f"{block_size}, its block table is {table}: allocate blocks before the step")
            slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx - n_new, ctx)]
        width = max(len(t) for t in block_tables)
        padded = [list(t) + [-1] * (width - len(t)) for t in block_tables]
        i32 = {"dtype": torch.int32, "device": device}
        return cls(block_tables=torch.tensor(padded, **i32), context_lens=torch.tensor(context_lens, **i32),
                   cu_seqlens_q=torch.tensor([0, *accumulate(query_lens)], **i32),
                   slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
                   host_query_lens=list(query_lens), host_context_lens=list(context_lens))


def _check_paged_inputs(q: Tensor, k_pool_layer: Tensor, v_pool_layer: Tensor, block_tables: Tensor) -> None:
    if q.dim() != 3 or k_pool_layer.dim() != 4 or k_pool_layer.shape != v_pool_layer.shape:
        raise ValueError(f"expected q (tokens, n_heads, head_dim) and k/v pools (num_blocks, block_size, "
                         f"n_kv_heads, head_dim) of one shape; got {tuple(q.shape)}, {tuple(k_pool_layer.shape)}, "
                         f"{tuple(v_pool_layer.shape)} (pass cache.k_pool[layer], not the whole pool)")
    if q.shape[2] != k_pool_layer.shape[3] or q.shape[1] % k_pool_layer.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not match pool {tuple(k_pool_layer.shape)}: head_dim must agree "
                         f"and n_kv_heads must divide n_heads")
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables must be an int (num_seqs, max_blocks) tensor, got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}")


def paged_attention(q: Tensor, k_pool_layer: Tensor, v_pool_layer: Tensor, block_tables: Tensor,
                    context_lens: Tensor) -> Tensor:
    """Decode attention through block tables, in torch: one query per sequence over its first context_lens keys.

    q (num_seqs, n_heads, head_dim); pools (num_blocks, block_size, n_kv_heads, head_dim); block_tables
    (num_seqs, max_blocks) (entries past a sequence's blocks may be -1); context_lens (num_seqs,).
    Returns (num_seqs, n_heads, head_dim). Slots past a sequence's length may hold anything (NaN included).
    """
    _check_paged_inputs(q, k_pool_layer, v_pool_layer, block_tables)
    if block_tables.shape[0] != q.shape[0] or context_lens.shape != (q.shape[0],):
        raise ValueError(f"{q.shape[0]} queries need {q.shape[0]} block table rows and context lengths, got "
                         f"{tuple(block_tables.shape)}, {tuple(context_lens.shape)}")
    n_seqs, n_heads, head_dim = q.shape
    n_kv_heads = k_pool_layer.shape[2]
    group = n_heads // n_kv_heads
    table = block_tables.long().clamp(min=0).flatten()  # -1 padding reads block 0; those slots are masked below
    # gathered (n_seqs * max_blocks, block_size, kv_heads, head_dim) -> (n_seqs, kv_heads, L = max_blocks * block_size,
    # head_dim): each sequence's keys in position order
    keys = k_pool_layer.index_select(0, table).view(n_seqs, -1, n_kv_heads, head_dim).transpose(1, 2)
    values = v_pool_layer.index_select(0, table).view(n_seqs, -1, n_kv_heads, head_dim).transpose(1, 2)
    valid = torch.arange(keys.shape[2], device=q.device) < context_lens.to(q.device)[:, None]  # (n_seqs, L)
    values = torch.where(valid[:, None, :, None], values, 0)  # 0 * NaN is NaN: clear unused slots, not just weights
    q_grouped = q.float().view(n_seqs, n_kv_heads, group, head_dim)  # query head h reads KV head h // group
    scores = (q_grouped @ keys.float().transpose(-1, -2)) * head_dim**-0.5  # (n_seqs, n_kv_heads, group, L)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = scores.softmax(dim=-1) @ values.float()  # (n_seqs, n_kv_heads, group, head_dim)
    return out.reshape(n_seqs, n_heads, head_dim).to(q.dtype)


def gather_sequence(pool_layer: Tensor, block_table: Tensor, context_len: int) -> Tensor:
    """One sequence's cached keys (or values) in order: (context_len, n_kv_heads, head_dim)."""
    n_blocks = blocks_needed(context_len, pool_layer.shape[1])
    return pool_layer.index_select(0, block_table[:n_blocks].long()).flatten(0, 1)[:context_len]


def context_slots(block_tables: Tensor, context_lens: Tensor, block_size: int, width: int) -> tuple[Tensor, Tensor]:
    """Each sequence's cached tokens as flat pool slots, in position order, padded to `width` positions.

    block_tables (n, max_blocks), context_lens (n,) -> slots (n, width) int64 indexing a layer's pool viewed as
    (num_blocks * block_size, n_kv_heads, head_dim), and valid (n, width), True at the sequence's real positions.
    Position p lives in slot table[p // block_size] * block_size + p % block_size (the module docstring's rule, for
    every position at once). Padding positions point at the sequence's position 0: a real, finite key/value the mask
    then excludes (a slot nobody owns may hold NaN, and a masked 0 weight times NaN is still NaN).
    """
    positions = torch.arange(width, device=block_tables.device)
    valid = positions < context_lens.to(block_tables.device)[:, None]  # (n, width)
    positions = torch.where(valid, positions, 0)
    blocks = block_tables.long().gather(1, positions // block_size)  # (n, width): block id of each position
    return blocks * block_size + positions % block_size, valid


def gathered_decode_attention(q: Tensor, k_slots: Tensor, v_slots: Tensor, slots: Tensor, valid: Tensor | None,
                              attn: AttentionFn = sdpa_attention) -> Tensor:
    """Decode attention over contexts gathered through precomputed slots (the CPU fast path of PagedKVCache).

    q (n, n_heads, head_dim), one query per sequence; k_slots/v_slots a layer's pool viewed as (num_slots,
    n_kv_heads, head_dim); slots/valid from `context_slots`. One index_select per pool copies every sequence's keys
    into a padded (n, n_kv_heads, width, head_dim) tensor, then one fused SDPA call masks the padding. valid None
    means every context fills the width (equal lengths): no mask, so the model's own backend `attn` runs instead.
    Returns (n, n_heads, head_dim).
    """
    n, n_heads, head_dim = q.shape
    n_kv_heads, width = k_slots.shape[1], slots.shape[1]
    flat = slots.flatten()
    # (n * width, n_kv_heads, head_dim) -> (n, n_kv_heads, width, head_dim); the transpose is a view SDPA reads as is
    keys = k_slots.index_select(0, flat).view(n, width, n_kv_heads, head_dim).transpose(1, 2)
    values = v_slots.index_select(0, flat).view(n, width, n_kv_heads, head_dim).transpose(1, 2)
    if valid is None:
        return attn(q[:, :, None], keys, values, causal=True)[:, :, 0]
    # GQA as in sdpa_attention's decode path: a KV head's group of query heads become its query rows, so each KV head
    # is read once: (n, n_heads, head_dim) -> (n, n_kv_heads, group, head_dim)
    q_grouped = q.reshape(n, n_kv_heads, n_heads // n_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q_grouped, keys, values, attn_mask=valid[:, None, None, :])
    return out.reshape(n, n_heads, head_dim)


@dataclass
class StepPlan:
    """How one forward's packed batch is attended, derived from its AttentionMetadata once and shared by all layers
    (the per-layer work is then only gathers and attention calls)."""

    decode_rows: Tensor | None  # packed rows of the one-token (decode) sequences; None: every row is a decode
    decode_seqs: list[int]  # their sequence indices
    decode_slots: Tensor | None  # (n_decode, longest decode context) flat pool slots, see context_slots
    decode_valid: Tensor | None  # (n_decode, longest) real positions; None when all decode contexts are equally long
    prefills: list[tuple[int, int, Tensor | None]]  # (first packed row, new tokens, context slots or None when the
    #                                                 whole context is new this step: attend over the new k/v as is)

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int) -> StepPlan:
        starts = list(accumulate(meta.host_query_lens, initial=0))
        decode = [i for i, n in enumerate(meta.host_query_lens) if n == 1]
        slots = valid = rows = None
        if decode:
            lens = [meta.host_context_lens[i] for i in decode]
            idx = torch.tensor(decode, device=meta.block_tables.device)
            slots, valid = context_slots(meta.block_tables[idx], meta.context_lens[idx], block_size, max(lens))
            valid = None if min(lens) == max(lens) else valid
            if len(decode) < meta.num_seqs:
                rows = torch.tensor([starts[i] for i in decode], device=meta.block_tables.device)
        prefills = []
        for i, n_new in enumerate(meta.host_query_lens):
            if n_new == 1:
                continue
            ctx = meta.host_context_lens[i]
            seq_slots = None
            if n_new < ctx:  # earlier tokens are cached (chunked prefill, prefix): read the context from the pool
                seq_slots = context_slots(meta.block_tables[i:i + 1], meta.context_lens[i:i + 1], block_size, ctx)[0][0]
            prefills.append((starts[i], n_new, seq_slots))
        return cls(rows, decode, slots, valid, prefills)


def paged_prefill_attention(q: Tensor, k_pool_layer: Tensor, v_pool_layer: Tensor, block_tables: Tensor,
                            context_lens: list[int], query_lens: list[int], attn: AttentionFn = sdpa_attention
                            ) -> Tensor:
    """Packed variable-length attention: sequence i's query_lens[i] queries (consecutive rows of q, in order) are
    its last positions among context_lens[i] cached keys (causal, bottom-right). q (N_total, n_heads, head_dim);
    returns the same shape. Loops over sequences and runs `attn` on each gathered context."""
    _check_paged_inputs(q, k_pool_layer, v_pool_layer, block_tables)
    if sum(query_lens) != q.shape[0] or not len(query_lens) == len(context_lens) == block_tables.shape[0]:
        raise ValueError(f"query_lens {query_lens} must sum to q's {q.shape[0]} rows, one per block table row")
    out = torch.empty_like(q)
    start = 0
    for table, ctx, n_new in zip(block_tables, context_lens, query_lens):
        keys = gather_sequence(k_pool_layer, table, ctx).transpose(0, 1)[None]  # (1, n_kv_heads, ctx, head_dim)
        values = gather_sequence(v_pool_layer, table, ctx).transpose(0, 1)[None]
        rows = slice(start, start + n_new)
        out[rows] = attn(q[rows].transpose(0, 1)[None], keys, values, causal=True)[0].transpose(0, 1)
        start += n_new
    return out


def _triton_usable(q: Tensor) -> bool:
    return q.is_cuda and importlib.util.find_spec("triton") is not None


class PagedKVCache:
    """K/V block pools for all layers plus the allocator that hands their blocks out (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int = 16, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", batch_size: int = 1):
        shape = (cfg.n_layers, num_blocks, block_size, cfg.n_kv_heads, cfg.head_dim)
        self.k_pool = torch.zeros(shape, dtype=dtype, device=device)
        self.v_pool = torch.zeros(shape, dtype=dtype, device=device)
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.config, self.num_blocks, self.block_size = cfg, num_blocks, block_size
        self.batch_size = batch_size  # sequences in self-managed mode
        # decode_backend: "auto" = Triton kernel on CUDA, gathered_decode_attention on CPU (the model's attention
        # backend when all sequences have one length, fused SDPA with a padding mask otherwise)
        # | "torch" = paged_attention (the exercise's reference gather) | "triton"
        self.decode_backend = "auto"
        self._plan: tuple[AttentionMetadata, StepPlan] | None = None  # the current forward's plan, built at layer 0
        self.block_tables_host: list[list[int]] = [[] for _ in range(batch_size)]
        self._seq_len = 0
        self._engine_mode = False
        self._meta: AttentionMetadata | None = None
        self._step: tuple[int, int] | None = None  # (seq_len, new tokens) the self-managed metadata was built for

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int, block_size: int = 16) -> PagedKVCache:
        """Enough blocks for `batch_size` sequences of `max_len` tokens each (self-managed mode)."""
        if max_len < 1 or batch_size < 1:
            raise ValueError(f"batch_size and max_len must be >= 1, got {batch_size}, {max_len}")
        if max_len > model.config.max_seq_len:
            raise ValueError(f"max_len {max_len} is past the model's context window ({model.config.max_seq_len})")
        num_blocks = batch_size * blocks_needed(max_len, block_size)
        return cls(model.config, num_blocks, block_size, model.dtype, model.device, batch_size=batch_size)

    @property
    def device(self) -> torch.device:
        return self.k_pool.device

    @property
    def seq_len(self) -> int:
        if self._engine_mode:
            raise RuntimeError("an engine-managed PagedKVCache has no single seq_len: pass positions to the model")
        return self._seq_len

    def bytes_per_block(self) -> int:
        return 2 * self.k_pool[:, 0].numel() * self.k_pool.element_size()

    def nbytes(self) -> int:
        """Bytes of the whole pool (reserved up front, like KVCache.nbytes)."""
        return 2 * self.k_pool.numel() * self.k_pool.element_size()

    def bytes_used(self) -> int:
        """Bytes of the blocks currently allocated to sequences."""
        return self.allocator.num_used() * self.bytes_per_block()

    def set_metadata(self, meta: AttentionMetadata, check: bool = True) -> None:
        """Describe the next forward's packed batch (engine mode). `check` verifies every block read is allocated
        and every block written has one owner (a shared block must be copied first): it syncs on CUDA."""
        if meta.block_tables.shape[0] != meta.num_seqs or meta.slot_mapping.shape != (meta.num_tokens,):
            raise ValueError(f"metadata is inconsistent: {meta.num_seqs} sequences, {meta.num_tokens} tokens, "
                             f"block_tables {tuple(meta.block_tables.shape)}, slots {tuple(meta.slot_mapping.shape)}")
        if check:
            tables = meta.block_tables.tolist()
            for i, ctx in enumerate(meta.host_context_lens):
                read = tables[i][: blocks_needed(ctx, self.block_size)]
                if len(read) * self.block_size < ctx or any(not 0 <= b < self.num_blocks or
                                                             self.allocator.ref_count(b) == 0 for b in read):
                    raise ValueError(f"sequence {i} reads blocks {read} for {ctx} tokens: some are missing or free")
            for b in set((meta.slot_mapping // self.block_size).tolist()):
                if not 0 <= b < self.num_blocks or self.allocator.ref_count(b) != 1:
                    raise ValueError(f"writing into block {b} with ref count "
                                     f"{self.allocator.ref_count(b) if 0 <= b < self.num_blocks else 'n/a'}: "
                                     f"only a block with one owner may be written (copy-on-write a shared one)")
        self._engine_mode, self._meta = True, meta

    def _metadata(self, batch: int, n_new: int) -> AttentionMetadata:
        if self._engine_mode:
            if self._meta is None:
                raise RuntimeError("no AttentionMetadata for this forward: call cache.set_metadata(meta) before each "
                                   "model call")
            return self._meta
        if (self._seq_len, n_new) != self._step:  # first layer of a new forward: grow block tables, build slots
            if batch != self.batch_size:
                raise ValueError(f"this cache holds {self.batch_size} sequences, got a batch of {batch}")
            new_len = self._seq_len + n_new
            missing = [blocks_needed(new_len, self.block_size) - len(t) for t in self.block_tables_host]
            if not self.allocator.can_allocate(sum(missing)):
                raise OutOfBlocksError(
                    f"{batch} sequence(s) of {new_len} tokens need {sum(missing)} more blocks, {self.allocator.num_free()}"
                    f" are free: build the cache with a larger max_len (prompt + max_new_tokens)")
            for table, n in zip(self.block_tables_host, missing):
                table += self.allocator.allocate(max(n, 0))
            self._meta = AttentionMetadata.build(self.block_tables_host, [new_len] * batch, [n_new] * batch,
                                                 self.block_size, self.device)
            self._step = (self._seq_len, n_new)
        return self._meta

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, attn: AttentionFn) -> Tensor:
        """Write k, v to their slots, then attend q over each sequence's cached tokens.

        q (batch, n_heads, new, head_dim), k/v (batch, n_kv_heads, new, head_dim); in engine mode batch is 1 and
        `new` is the packed N_total."""
        batch, n_heads, n_new, head_dim = q.shape
        meta = self._metadata(batch, n_new)
        if batch * n_new != meta.num_tokens:
            raise ValueError(f"got {batch * n_new} new tokens, the metadata describes {meta.num_tokens}")
        n_kv_heads = k.shape[1]
        # (batch, heads, new, head_dim) -> (batch * new, heads, head_dim): sequence b's tokens are rows b*new ...
        q_packed = q.transpose(1, 2).reshape(-1, n_heads, head_dim)
        k_slots = self.k_pool[layer].view(-1, n_kv_heads, head_dim)  # (num_blocks * block_size, ...) view of the pool
        v_slots = self.v_pool[layer].view(-1, n_kv_heads, head_dim)
        k_new = k.transpose(1, 2).reshape(-1, n_kv_heads, head_dim).to(k_slots.dtype)  # (N_total, n_kv_heads, head_dim)
        v_new = v.transpose(1, 2).reshape(-1, n_kv_heads, head_dim).to(v_slots.dtype)
        k_slots.index_copy_(0, meta.slot_mapping, k_new)
        v_slots.index_copy_(0, meta.slot_mapping, v_new)
        out = self._attend_packed(layer, q_packed, k_new, v_new, meta, attn)
        return out.view(batch, n_new, n_heads, head_dim).transpose(1, 2)

    def _step_plan(self, meta: AttentionMetadata) -> StepPlan:
        if self._plan is None or self._plan[0] is not meta:  # first layer of this forward
            self._plan = (meta, StepPlan.build(meta, self.block_size))
        return self._plan[1]

    def _attend_packed(self, layer: int, q: Tensor, k_new: Tensor, v_new: Tensor, meta: AttentionMetadata,
                       attn: AttentionFn) -> Tensor:
        """q (N_total, n_heads, head_dim), k_new/v_new (N_total, n_kv_heads, head_dim) -> q's shape."""
        plan = self._step_plan(meta)
        if not plan.prefills:  # pure decode step: no copies in or out
            return self._decode(layer, q, meta, plan, attn)
        out = torch.empty_like(q)
        if plan.decode_seqs:
            out[plan.decode_rows] = self._decode(layer, q[plan.decode_rows], meta, plan, attn)
        k_pool, v_pool = self.k_pool[layer].flatten(0, 1), self.v_pool[layer].flatten(0, 1)  # (num_slots, Hkv, D)
        for start, n_new, slots in plan.prefills:  # one attention call per prompt (chunk), causal bottom-right
            rows = slice(start, start + n_new)
            keys, values = ((k_new[rows], v_new[rows]) if slots is None
                            else (k_pool.index_select(0, slots), v_pool.index_select(0, slots)))
            # (len, heads, head_dim) -> (1, heads, len, head_dim), the backend's layout
            out[rows] = attn(q[rows].transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                             causal=True)[0].transpose(0, 1)
        return out

    def _decode(self, layer: int, q: Tensor, meta: AttentionMetadata, plan: StepPlan, attn: AttentionFn) -> Tensor:
        """q (n, n_heads, head_dim), one query per decode sequence of the plan -> (n, n_heads, head_dim)."""
        backend = self.decode_backend
        if backend == "auto" and not _triton_usable(q):
            n_kv_heads, head_dim = self.config.n_kv_heads, self.config.head_dim
            return gathered_decode_attention(q, self.k_pool[layer].view(-1, n_kv_heads, head_dim),
                                             self.v_pool[layer].view(-1, n_kv_heads, head_dim),
                                             plan.decode_slots, plan.decode_valid, attn)
        idx = plan.decode_seqs if len(plan.decode_seqs) < meta.num_seqs else slice(None)
        host_lens = [meta.host_context_lens[i] for i in plan.decode_seqs]
        tables = meta.block_tables[idx][:, : blocks_needed(max(host_lens), self.block_size)]  # no wider than needed
        context_lens = meta.context_lens[idx]
        if backend == "triton" or backend == "auto":
            from minillm_kernels.paged_decode import triton_paged_decode

            return triton_paged_decode(q, self.k_pool[layer], self.v_pool[layer], tables, context_lens)
        return paged_attention(q, self.k_pool[layer], self.v_pool[layer], tables, context_lens)

    def advance(self, n_tokens: int) -> None:
        if self._engine_mode:
            self._meta = None  # used: the next forward must describe its own batch
        else:
            self._seq_len += n_tokens

    def reset(self) -> None:
        """Free every block and return to an empty self-managed cache."""
        self.allocator.reset()
        self.block_tables_host = [[] for _ in range(self.batch_size)]
        self._seq_len, self._engine_mode, self._meta, self._step, self._plan = 0, False, None, None, None
