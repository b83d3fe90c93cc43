"""Exercise 13: disaggregated prefill/decode and routing across replicas (lesson 13, "serving at scale").

Disaggregation runs prefill and decode on different engines: the prefill engine computes a prompt's keys and values
and its first token, then ships the KV blocks to a decode engine, which continues as if it had computed them itself.
The blocks are scattered over the sender's pool and land in other block ids of the receiver's pool. Replication runs
N engines behind a router that picks one per request: by load, or by which replica most likely caches the request's
prefix. Write the transfer's gather and scatter, and the router, then grade your work:

    minillm grade 13

- 13.pack: a KVBlockPool stores "k" and "v", each (n_layers, num_blocks, block_size, n_kv_heads, head_dim), and for
  an int8 pool their scales "k_scale" and "v_scale", (n_layers, num_blocks, block_size, n_kv_heads) in float16;
  `stored_tensors(pool)` (given) returns exactly these by name. `pack_kv_blocks(pool, block_table, num_tokens)`
  returns the KV of a sequence's first num_tokens tokens: one tensor per stored name, same dtype, shape
  (n_layers, n_blocks, ...the pool's other dims) with n_blocks = ceil(num_tokens / block_size) (a partly filled last
  block is sent whole: the receiver reads only num_tokens of it); packed block i is pool block block_table[i], for
  every layer. The payload is new, contiguous memory: the sender frees and reuses its blocks while the payload
  travels, and nothing written to either side afterwards may show in the other. num_tokens < 1 or more tokens than
  the table's blocks hold: ValueError. pack changes nothing in the pool.
  `unpack_kv_blocks(pool, block_table, payload)` writes packed block i into block block_table[i] of `pool` (blocks
  the caller allocated, in the table's order, whatever their ids), every stored tensor, scales included, and touches
  no other block. A payload that does not fit (other names, dtypes, block size, heads, layers, or not exactly one
  block id per packed block) is a ValueError before anything is written: `check_payload(pool, n_blocks, payload)`
  (given) raises it.
- 13.route: replicas are `ReplicaState`s (given): `.id`, `.alive`, `.outstanding_tokens` (the work a replica still
  owes: unprefilled prompt tokens plus tokens still to generate, summed over its in-flight requests).
  `least_loaded(replicas)` returns the live replica (the ReplicaState) with the fewest outstanding tokens, not the
  fewest requests; ties go to the lowest id; no live replica is a RuntimeError (`live(replicas)`, given, raises it).
  `PrefixAffinityRouter` remembers, per replica, the chained block hashes (`block_hashes(prompt_ids, block_size)`,
  given: one per full block) of the prompts routed there, in `self._seen[replica_id]`, an OrderedDict of hash ->
  None, least recently used first, at most max_blocks per replica.
  `matched_blocks(replica_id, hashes)`: how many *leading* hashes that replica's memory holds (a remembered hash
  after a missing one does not count: the engine's cache is only read from a sequence's first block).
  `on_dispatch(replica_id, prompt_ids)`: remember the prompt's hashes there, every one of them now the most recently
  used, its first block the most recent of all (so that an overflow beyond max_blocks drops chains' tails before
  their heads, as the engine does), then drop the least recently used beyond max_blocks.
  `is_imbalanced(candidate, lightest)`: the candidate owes more than balance_abs tokens more than the lightest AND
  more than balance_rel times as many (strictly, both).
  `choose(prompt_ids, max_tokens, replicas)` returns a live replica's id: the one with the longest match (ties: fewer
  outstanding tokens, then lower id), unless nothing matches or that replica is imbalanced against the lightest
  live replica (fewest outstanding tokens; ties: fewest remembered blocks, then lowest id), in which case the
  lightest. A prompt shorter than a block has no hash, so it matches nothing. choose only reads: it remembers
  nothing (on_dispatch does, once the request is sent). __init__, num_remembered and on_replica_down are given.

The graders compare with oracles written out in the grader: pack and unpack against a block-by-block copy loop on
crafted pools (scattered and reversed tables, a partial last block, int8 pools with scales, several layers, the
receiver's other blocks checked untouched, every bad input) and on random shapes and tables (hypothesis); the
router on crafted replica states and request streams (ties, dead replicas, longest match, block alignment, both
balance thresholds at their boundaries, the LRU bound) and on random streams against a plain model of the memory.
The real-model task runs SmolLM2-135M disaggregated in one process: your pack_kv_blocks and unpack_kv_blocks in
minillm.cache.kv_transfer, LLM.add_prefill on one engine and LLM.add_prefilled on a second one whose free blocks come in
another order (float32 and int8 KV): the greedy tokens of a single engine; then your PrefixAffinityRouter routes a
stream of chat requests sharing system prompts over two prefix-caching engines: the same choices and prefix hits as
minillm's router. Calling minillm.cache.kv_transfer's or minillm.serving.router's own functions is rejected.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch  # noqa: F401  (you will need it)
from torch import Tensor

from minillm.cache.kv_pool import KVBlockPool  # the pool: .k, .v, .k_scale, .v_scale, .spec.block_size
from minillm.cache.kv_transfer import check_payload, stored_tensors  # noqa: F401  (given: the payload check, the tensors)
from minillm.cache.prefix_cache import block_hashes  # noqa: F401  (given: the engine's chained block hashes, lesson 12)
from minillm.serving.router import ReplicaState, Router, live  # noqa: F401  (given: replica state, base class, live filter)

# task 13.pack -------------------------------------------------------------------------------------------------


def pack_kv_blocks(pool: KVBlockPool, block_table: list[int], num_tokens: int) -> dict[str, Tensor]:
    """The KV of a sequence's first `num_tokens` tokens, copied out of its blocks into contiguous tensors.

    Returns {"k", "v"} each (n_layers, n_blocks, block_size, n_kv_heads, head_dim) with n_blocks =
    ceil(num_tokens / block_size) (the last block may be partly filled: the receiver only reads num_tokens of it),
    plus "k_scale" / "v_scale" (n_layers, n_blocks, block_size, n_kv_heads) for an int8 pool."""
    raise NotImplementedError(
        "task 13.pack: pack: n_blocks = -(-num_tokens // pool.spec.block_size) (ceil: the partial last block goes "
        "too); ValueError unless num_tokens >= 1 and n_blocks <= len(block_table); idx = "
        "torch.tensor(block_table[:n_blocks], dtype=torch.long, device=pool.k.device); return {name: t[:, idx] for "
        "name, t in stored_tensors(pool).items()} (indexing with a tensor copies; slicing t[:, a:b] would be a view "
        "the pool later overwrites)")


def unpack_kv_blocks(pool: KVBlockPool, block_table: list[int], payload: dict[str, Tensor]) -> None:
    """Write a packed payload into `block_table` (blocks of `pool` the caller already allocated), in order.

    Raises ValueError, naming what differs, if the payload does not fit this pool (other kv dtype, block size,
    heads, layers, or not one block id per packed block)."""
    raise NotImplementedError(
        "task 13.pack: unpack: check_payload(pool, len(block_table), payload) first (it raises before anything is "
        "written); idx = torch.tensor(block_table, dtype=torch.long, device=pool.k.device) in the table's order (not "
        "sorted); for name, t in stored_tensors(pool).items() (the scales too): t[:, idx] = payload[name]")


# task 13.route ------------------------------------------------------------------------------------------------


def least_loaded(replicas: Sequence[ReplicaState]) -> ReplicaState:
    """The live replica with the fewest outstanding tokens (ties: the lowest id)."""
    raise NotImplementedError(
        "task 13.route: least_loaded: min over live(replicas) (RuntimeError if none) with key "
        "(r.outstanding_tokens, r.id): tokens, not len(r.in_flight); the lowest id wins a tie")


class PrefixAffinityRouter(Router):
    """The live replica most likely to hold the request's longest cached prefix, unless that replica is overloaded.

    Memory: per replica, the block hashes of the prompts routed there, at most `max_blocks` (LRU; size it like the
    replica's KV pool in blocks). Fallback to the least loaded replica (ties: the one remembering the fewest blocks,
    then the lowest id) when nothing matches, or when the best match's outstanding tokens exceed the least loaded
    replica's by more than `balance_abs` tokens AND more than `balance_rel` times."""

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
        raise NotImplementedError(
            "task 13.route: matched_blocks: seen = self._seen.get(replica_id, {}); count hashes from the first "
            "while each is in seen, and stop at the first that is not (a later remembered hash does not count)")

    def is_imbalanced(self, candidate: ReplicaState, lightest: ReplicaState) -> bool:
        raise NotImplementedError(
            "task 13.route: is_imbalanced: a, b = candidate.outstanding_tokens, lightest.outstanding_tokens; "
            "return a - b > self.balance_abs and a > self.balance_rel * b (both, strictly)")

    def choose(self, prompt_ids, max_tokens, replicas) -> int:
        raise NotImplementedError(
            "task 13.route: choose: hashes = block_hashes(prompt_ids, self.block_size); lightest = min over "
            "live(replicas) by (r.outstanding_tokens, self.num_remembered(r.id), r.id); best = min over "
            "live(replicas) by (-self.matched_blocks(r.id, hashes), r.outstanding_tokens, r.id); return lightest.id "
            "if best matches 0 blocks or self.is_imbalanced(best, lightest), else best.id (remember nothing here)")

    def on_dispatch(self, replica_id: int, prompt_ids: Sequence[int]) -> None:
        """Remember the prompt's blocks on that replica. Inserted tail first, so the head is the most recently used:
        eviction drops a chain's tail before its head, like the engine (a chain only ever matches from its head)."""
        raise NotImplementedError(
            "task 13.route: on_dispatch: seen = self._seen.setdefault(replica_id, OrderedDict()); for h in "
            "reversed(block_hashes(prompt_ids, self.block_size)): seen[h] = None; seen.move_to_end(h) (a known hash "
            "becomes recent again); then while len(seen) > self.max_blocks: seen.popitem(last=False)")

    def on_replica_down(self, replica_id: int) -> None:
        self._seen.pop(replica_id, None)  # its cache died with it

    def num_remembered(self, replica_id: int) -> int:
        return len(self._seen.get(replica_id, ()))
