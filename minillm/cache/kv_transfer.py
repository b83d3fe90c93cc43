"""KV transfer for disaggregated serving (lesson 13): a request's KV blocks from a prefill to a decode pool.

Disaggregation (DistServe, Splitwise) runs compute-bound prefill and memory-bound decode on separate workers,
so a long prompt no longer stalls other requests' decodes; the price is shipping the prompt's KV. Blocks are
scattered in both pools: `pack_kv_blocks` gathers a sequence's blocks into contiguous tensors in token order,
`unpack_kv_blocks` writes them into the receiver's own blocks; `KVHandoff` is the request that travels with
them. Engine seam: handoff.py; processes and the wire: cluster/disagg.py. Exercise 13 asks for both functions.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
from torch import Tensor

from minillm.cache.kv_pool import KVBlockPool
from minillm.sampling import SamplingParams


def stored_tensors(pool: KVBlockPool) -> dict[str, Tensor]:
    """A pool's storage by payload name: "k", "v" (n_layers, num_blocks, block_size, n_kv_heads, head_dim) and, for
    an int8 pool, their scales "k_scale", "v_scale" (n_layers, num_blocks, block_size, n_kv_heads)."""
    named = {"k": pool.k, "v": pool.v, "k_scale": pool.k_scale, "v_scale": pool.v_scale}
    return {name: t for name, t in named.items() if t is not None}


def pack_kv_blocks(pool: KVBlockPool, block_table: list[int], num_tokens: int) -> dict[str, Tensor]:
    """The KV of a sequence's first `num_tokens` tokens, copied out of its blocks into contiguous tensors.

    Returns {"k", "v"} each (n_layers, n_blocks, block_size, n_kv_heads, head_dim) with n_blocks =
    ceil(num_tokens / block_size) (the last block may be partly filled: the receiver only reads num_tokens of it),
    plus "k_scale" / "v_scale" (n_layers, n_blocks, block_size, n_kv_heads) for an int8 pool."""
    n_blocks = -(-num_tokens // pool.spec.block_size)  # ceil
    if num_tokens < 1 or n_blocks > len(block_table):
        raise ValueError(f"cannot pack {num_tokens} tokens from {len(block_table)} blocks of "
                         f"{pool.spec.block_size}: need 1 <= num_tokens <= {len(block_table) * pool.spec.block_size}")
    idx = torch.tensor(block_table[:n_blocks], dtype=torch.long, device=pool.k.device)
    # indexing with a tensor gathers into new memory: the pool may reuse these blocks while the payload travels
    return {name: t[:, idx] for name, t in stored_tensors(pool).items()}  # dim 1 is the block


def unpack_kv_blocks(pool: KVBlockPool, block_table: list[int], payload: dict[str, Tensor]) -> None:
    """Write a packed payload into `block_table` (blocks of `pool` the caller already allocated), in order.

    Raises ValueError, naming what differs, if the payload does not fit this pool (other kv dtype, block size,
    heads, layers, or not one block id per packed block)."""
    check_payload(pool, len(block_table), payload)
    idx = torch.tensor(block_table, dtype=torch.long, device=pool.k.device)
    for name, t in stored_tensors(pool).items():
        t[:, idx] = payload[name].to(t.device)  # packed block i lands in block_table[i]


def check_payload(pool: KVBlockPool, n_blocks: int, payload: dict[str, Tensor]) -> None:
    """Raise ValueError unless `payload` is n_blocks packed blocks that fit `pool` (same tensors, dtypes, dims)."""
    stored = stored_tensors(pool)
    if set(payload) != set(stored):
        raise ValueError(f"the payload carries {sorted(payload)} but this pool stores {sorted(stored)}: "
                         f"both engines need the same kv_cache_dtype")
    for name, want in stored.items():
        got = payload[name]
        if got.dtype != want.dtype:
            raise ValueError(f"{name}: payload dtype {got.dtype}, pool dtype {want.dtype}: same kv_cache_dtype needed")
        shape = (want.shape[0], n_blocks, *want.shape[2:])
        if tuple(got.shape) != shape:
            raise ValueError(f"{name}: payload shape {tuple(got.shape)}, expected {shape} for {n_blocks} blocks "
                             f"(n_layers, n_blocks, block_size, n_kv_heads[, head_dim]): the block size, heads and "
                             f"layers must match")


def kv_checksum(payload: dict[str, Tensor]) -> str:
    """sha256 over the payload's names, dtypes, shapes and bytes: equal on both sides iff the transfer was exact."""
    h = hashlib.sha256()
    for name in sorted(payload):
        t = payload[name].detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # hashed in place, no copy
    return h.hexdigest()


def payload_nbytes(payload: dict[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in payload.values())


@dataclass
class KVHandoff:
    """Everything a decode engine needs to continue a request that another engine prefilled."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]  # the first token (sampled by the prefill engine)
    params: SamplingParams  # the caller's, unchanged (max_tokens counts the first token)
    stop_ids: frozenset[int]  # the request's stop set, as the prefill engine resolved it
    generator_state: Tensor | None  # the per-request RNG after the first sample (seeded sampling continues exactly)
    num_computed_tokens: int  # tokens whose KV is in the payload (the prompt; the first token's KV is not computed)
    block_size: int
    payload: dict[str, Tensor] = field(repr=False)
    checksum: str = ""
    nbytes: int = 0
    finish_reason: str | None = None  # set if the first token already finished the request (nothing to decode)
    arrival_time: float = 0.0  # time.perf_counter() clock of the machine (one host: the same in every process)
    first_token_time: float = 0.0

    def header(self) -> dict:
        """Every field but the tensors, plus the tensors' names/shapes/dtypes: what goes first on the wire."""
        head = {k: v for k, v in self.__dict__.items() if k not in ("payload", "generator_state")}
        head["tensors"] = [(n, tuple(t.shape), t.dtype) for n, t in sorted(self.payload.items())]
        head["generator_state"] = None if self.generator_state is None else self.generator_state.tolist()
        return head

    @classmethod
    def from_header(cls, head: dict, payload: dict[str, Tensor]) -> KVHandoff:
        fields = {k: v for k, v in head.items() if k != "tensors"}
        if fields["generator_state"] is not None:
            fields["generator_state"] = torch.tensor(fields["generator_state"], dtype=torch.uint8)
        return cls(payload=payload, **fields)


__all__ = ["KVHandoff", "check_payload", "kv_checksum", "pack_kv_blocks", "payload_nbytes", "stored_tensors",
           "unpack_kv_blocks"]
