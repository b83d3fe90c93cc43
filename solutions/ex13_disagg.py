"""Exercise 13 (reference solutions): moving KV blocks between engines, and routing requests between replicas.

pack_kv_blocks and unpack_kv_blocks are verbatim copies of minillm.cache.kv_transfer's, least_loaded and
PrefixAffinityRouter of minillm.cluster.router's (see SAME_AS; tests/test_exercise_sync.py keeps them in sync).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor

from minillm.cache.kv_pool import KVBlockPool
from minillm.cache.kv_transfer import check_payload, stored_tensors
from minillm.cache.prefix_cache import block_hashes
from minillm.cluster.router import ReplicaState, Router, live

SAME_AS = {
    "pack_kv_blocks": "minillm.cache.kv_transfer",
    "unpack_kv_blocks": "minillm.cache.kv_transfer",
    "least_loaded": "minillm.cluster.router",
    "PrefixAffinityRouter": "minillm.cluster.router",
}

# task 13.pack -------------------------------------------------------------------------------------------------


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


# task 13.route ------------------------------------------------------------------------------------------------


def least_loaded(replicas: Sequence[ReplicaState]) -> ReplicaState:
    """The live replica with the fewest outstanding tokens (ties: the lowest id)."""
    return min(live(replicas), key=lambda r: (r.outstanding_tokens, r.id))


class PrefixAffinityRouter(Router):
    """The live replica most likely to hold the request's longest cached prefix, unless that replica is overloaded.

    Memory: per replica, the block hashes of the prompts routed there, at most `max_blocks` (LRU; size it like the
    replica's KV pool in blocks). Fallback to the least loaded replica (ties: the one remembering the fewest blocks,
    then the lowest id) when nothing matches, or when the best match's outstanding tokens exceed the least loaded
    replica's by more than `balance_abs` tokens AND more than `balance_rel` times (both must hold: a small absolute
    gap is noise, a large gap between two busy replicas may be a small ratio). The defaults tolerate about one long
    prompt's prefill of imbalance: cheaper to queue behind it than to compute the prefix again elsewhere."""

    name = "prefix_affinity"

    def __init__(self, block_size: int = 16, max_blocks: int = 4096, balance_abs: int = 1024,
                 balance_rel: float = 1.5):
        if block_size < 1 or max_blocks < 1:
            raise ValueError(f"block_size and max_blocks must be >= 1, got {block_size} and {max_blocks}")
        if balance_abs < 0 or balance_rel < 1.0:
            raise ValueError(f"need balance_abs >= 0 tokens and balance_rel >= 1.0, got {balance_abs}, {balance_rel}")
        self.block_size, self.max_blocks = block_size, max_blocks
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self._seen: dict[int, OrderedDict[bytes, None]] = {}  # replica -> block hashes, least recently used first

    def matched_blocks(self, replica_id: int, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt (its hashes) the router believes the replica has cached."""
        seen = self._seen.get(replica_id, {})
        n = 0
        while n < len(hashes) and hashes[n] in seen:
            n += 1
        return n

    def is_imbalanced(self, candidate: ReplicaState, lightest: ReplicaState) -> bool:
        a, b = candidate.outstanding_tokens, lightest.outstanding_tokens
        return a - b > self.balance_abs and a > self.balance_rel * b

    def choose(self, prompt_ids, max_tokens, replicas) -> int:
        hashes = block_hashes(prompt_ids, self.block_size)
        # the least loaded; among equals, the one remembering the fewest blocks: a new prefix goes to the emptiest cache
        lightest = min(live(replicas), key=lambda r: (r.outstanding_tokens, self.num_remembered(r.id), r.id))
        # longest match first; among equal matches the less loaded, then the lower id
        best = min(live(replicas), key=lambda r: (-self.matched_blocks(r.id, hashes), r.outstanding_tokens, r.id))
        if self.matched_blocks(best.id, hashes) == 0 or self.is_imbalanced(best, lightest):
            return lightest.id
        return best.id

    def on_dispatch(self, replica_id: int, prompt_ids: Sequence[int]) -> None:
        """Remember the prompt's blocks on that replica. Inserted tail first, so the head is the most recently used:
        eviction drops a chain's tail before its head, like the engine (a chain only ever matches from its head)."""
        seen = self._seen.setdefault(replica_id, OrderedDict())
        for h in reversed(block_hashes(prompt_ids, self.block_size)):
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.max_blocks:
            seen.popitem(last=False)

    def on_replica_down(self, replica_id: int) -> None:
        self._seen.pop(replica_id, None)  # its cache died with it

    def num_remembered(self, replica_id: int) -> int:
        return len(self._seen.get(replica_id, ()))
