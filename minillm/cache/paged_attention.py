"""Attention through block tables (lesson 04): what the paged KV cache (paged.py) runs, and its metadata.

Token p of a sequence with block table T lives in pool slot T[p // block_size] * block_size + p % block_size.
`AttentionMetadata`: one packed forward's batch (block tables, context/query lengths, new tokens' slots);
`slot_mapping`: the write path; `paged_attention`: the readable reference (gather, upcast, mask, softmax);
`StepPlan`, `context_slots`, `gathered_decode_attention`: the CPU fast path (slots once per step, one SDPA);
`paged_prefill_attention`: prompt chunks. GPU decode: kernels/paged_decode.py; attention.py's registry names
them all. Exercise 04 asks for slot_mapping and context_slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import Tensor

from minillm.attention import AttentionFn, sdpa_attention
from minillm.cache.block_allocator import blocks_needed

__all__ = ["AttentionMetadata", "StepPlan", "context_slots", "gather_sequence", "gathered_decode_attention",
           "paged_attention", "paged_prefill_attention", "slot_mapping"]


@dataclass
class AttentionMetadata:
    """Where one packed forward's tokens go and what each sequence attends over (built by the engine's runner)."""

    block_tables: Tensor  # (num_seqs, max_blocks) int32, row i = sequence i's block ids, padded with -1
    context_lens: Tensor  # (num_seqs,) int32: tokens cached per sequence after this step (new ones included)
    cu_seqlens_q: Tensor  # (num_seqs + 1,) int32: sequence i's new tokens are packed rows cu[i] .. cu[i+1]-1
    slot_mapping: Tensor  # (N_total,) int64: pool slot of each new token
    host_query_lens: list[int]  # the same numbers on the host, so attend can split decode/prefill without a sync
    host_context_lens: list[int]
    host_block_tables: list[list[int]]  # and the tables, so the cache can validate a step without reading tensors

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
        for i, (table, ctx, n_new) in enumerate(zip(block_tables, context_lens, query_lens)):
            if not 1 <= n_new <= ctx:
                raise ValueError(f"sequence {i}: need 1 <= query_len <= context_len, got {n_new}, {ctx}")
            if len(table) < blocks_needed(ctx, block_size) or any(b < 0 for b in table):
                raise ValueError(f"sequence {i}: {ctx} tokens need {blocks_needed(ctx, block_size)} blocks of "
                                 f"{block_size}, its block table is {table}: allocate blocks before the step")
        slots = slot_mapping(block_tables, context_lens, query_lens, block_size)  # the module global: swappable
        width = max(len(t) for t in block_tables)
        padded = [list(t) + [-1] * (width - len(t)) for t in block_tables]
        i32 = {"dtype": torch.int32, "device": device}
        return cls(block_tables=torch.tensor(padded, **i32), context_lens=torch.tensor(context_lens, **i32),
                   cu_seqlens_q=torch.tensor([0, *accumulate(query_lens)], **i32),
                   slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
                   host_query_lens=list(query_lens), host_context_lens=list(context_lens),
                   host_block_tables=[list(t) for t in block_tables])


def slot_mapping(block_tables: list[list[int]], context_lens: list[int], query_lens: list[int], block_size: int
                 ) -> list[int]:
    """The write path: the pool slot of every new token of one packed forward, in packed order.

    Sequence i's query_lens[i] new tokens are its last positions, context_lens[i] - query_lens[i] ..
    context_lens[i] - 1 (a whole prompt, a chunk of one, or one decode token); position p lives in slot
    table[p // block_size] * block_size + p % block_size. AttentionMetadata.build checks the lists first.
    """
    slots: list[int] = []
    for table, ctx, n_new in zip(block_tables, context_lens, query_lens):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx - n_new, ctx)]
    return slots


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


def gathered_decode_attention(q: Tensor, keys: Tensor, values: Tensor, valid: Tensor | None,
                              attn: AttentionFn = sdpa_attention) -> Tensor:
    """Decode attention over contexts already gathered through their slots (the CPU fast path of PagedKVCache).

    q (n, n_heads, head_dim), one query per sequence; keys/values (n, width, n_kv_heads, head_dim), each sequence's
    context padded to `width` (KVBlockPool.read of the slots from `context_slots`); valid (n, width) marks the real
    positions. One fused SDPA call masks the padding. valid None means every context fills the width (equal
    lengths): no mask, so the model's own dense backend `attn` runs instead. Returns (n, n_heads, head_dim).
    """
    n, n_heads, head_dim = q.shape
    n_kv_heads = keys.shape[2]
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # (n, n_kv_heads, width, head_dim), views
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
