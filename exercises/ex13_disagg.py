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
minillm's router. Calling minillm.cache.kv_transfer's or minillm.cluster.router's own functions is rejected.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch  # noqa: F401  (you will need it)
from torch import Tensor

from minillm.cache.kv_pool import KVBlockPool  # the pool: .k, .v, .k_scale, .v_scale, .spec.block_size
from minillm.cache.kv_transfer import check_payload, stored_tensors  # noqa: F401  (given: the payload check, the tensors)
from minillm.cache.prefix_cache import block_hashes  # noqa: F401  (given: the engine's chained block hashes, lesson 12)
from minillm.cluster.router import ReplicaState, Router, live  # noqa: F401  (given: replica state, base class, live filter)

# task 13.pack -------------------------------------------------------------------------------------------------


def pack_kv_blocks(pool: KVBlockPool, block_table: list[int], num_tokens: int) -> dict[str, Tensor]:
    """The KV of a sequence's first `num_tokens` tokens, copied out of its blocks into contiguous tensors.

    Returns {"k", "v"} each (n_layers, n_blocks, block_size, n_kv_heads, head_dim) with n_blocks =
    ceil(num_tokens / block_size) (the last block may be partly filled: the receiver only reads num_tokens of it),
    plus "k_scale" / "v_scale" (n_layers, n_blocks, block_size, n_kv_heads) for an int8 pool.

    One entry per name of the given stored_tensors(pool), same dtype and device; packed block i is pool block
    block_table[i], every layer. New memory: nothing written to the pool afterwards may show in the payload. The pool
    is left unchanged. ValueError for num_tokens < 1 or more tokens than the table's blocks hold. Example: block_size
    4, block_table [9, 2, 5], num_tokens 6: 2 blocks, packed block 0 is pool block 9 and packed block 1 is pool
    block 2 (holding tokens 4 and 5 and two unused slots); block 5 is not sent.
    """
    raise NotImplementedError("task 13.pack: see the docstring; `minillm hint 13 pack` for hints")


def unpack_kv_blocks(pool: KVBlockPool, block_table: list[int], payload: dict[str, Tensor]) -> None:
    """Write a packed payload into `block_table` (blocks of `pool` the caller already allocated), in order.

    Raises ValueError, naming what differs, if the payload does not fit this pool (other kv dtype, block size,
    heads, layers, or not one block id per packed block).

    The given check_payload(pool, n_blocks, payload) makes that check; it must run before anything is written.
    Packed block i goes into pool block block_table[i], every stored tensor (an int8 pool's scales too), in the
    table's order whatever its ids; no other block changes. Example: a 2-block payload into block_table [7, 3]:
    packed block 0 lands in block 7 and packed block 1 in block 3; a block_table of 3 ids raises and writes nothing.
    """
    raise NotImplementedError("task 13.pack: see the docstring; `minillm hint 13 pack` for hints")


# task 13.route ------------------------------------------------------------------------------------------------


def least_loaded(replicas: Sequence[ReplicaState]) -> ReplicaState:
    """The live replica with the fewest outstanding tokens (ties: the lowest id).

    Returns the ReplicaState itself. Load is outstanding tokens (what a replica still owes), not its number of
    requests; no live replica is a RuntimeError (the given live() raises it). Example: replicas 0 (dead, 0 tokens),
    1 (alive, 300 tokens in 1 request), 2 (alive, 120 tokens in 4 requests), 3 (alive, 120 tokens): replica 2.
    """
    raise NotImplementedError("task 13.route: see the docstring; `minillm hint 13 route` for hints")


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
        """How many leading blocks of a prompt (its hashes) the router believes the replica has cached.

        Counts from the first hash while each is remembered for that replica, and stops at the first that is not;
        a replica never seen remembers nothing. Reads only. Example: remembered {a, c}: hashes [a, b, c] match 1,
        [b, c] match 0.
        """
        raise NotImplementedError("task 13.route: see the docstring; `minillm hint 13 route` for hints")

    def is_imbalanced(self, candidate: ReplicaState, lightest: ReplicaState) -> bool:
        """Whether sending the request to `candidate` (the best match) would overload it against `lightest`.

        True when the candidate owes more than balance_abs tokens more than the lightest AND more than balance_rel
        times as many, both strictly. Example: balance_abs 64, balance_rel 1.5: 200 vs 100 is imbalanced (gap 100 >
        64, 200 > 150); 150 vs 100 is not (150 is not > 150); 100 vs 0 is imbalanced; 60 vs 0 is not (gap 60).
        """
        raise NotImplementedError("task 13.route: see the docstring; `minillm hint 13 route` for hints")

    def choose(self, prompt_ids, max_tokens, replicas) -> int:
        """The id of the live replica this request goes to (the class docstring gives the policy).

        Among live replicas: the best is the longest leading match of the prompt's block hashes (the given
        block_hashes, at self.block_size), ties to fewer outstanding tokens, then the lower id; the lightest has the
        fewest outstanding tokens, ties to fewer remembered blocks, then the lower id. The best wins unless it
        matches nothing or is_imbalanced(best, lightest); then the lightest. Remembers nothing (on_dispatch does).
        Example: replica 0 remembers the prompt's first 3 blocks and owes 500 tokens, replica 1 owes 0 (balance_abs
        1024): replica 0; owing 5000 instead, it is imbalanced (gap > 1024 and > 1.5x): replica 1.
        """
        raise NotImplementedError("task 13.route: see the docstring; `minillm hint 13 route` for hints")

    def on_dispatch(self, replica_id: int, prompt_ids: Sequence[int]) -> None:
        """Remember the prompt's blocks on that replica. Inserted tail first, so the head is the most recently used:
        eviction drops a chain's tail before its head, like the engine (a chain only ever matches from its head).

        Every hash of the prompt becomes recently used (one already remembered moves too), the first block's the
        most recent of all; then the least recently used beyond max_blocks are forgotten. Example: max_blocks 3, a
        prompt of hashes [a, b, c, d]: the memory keeps [c, b, a] from least to most recent (d, the tail, is
        dropped); a later prompt [a, e] leaves [b, e, a]: c, the least recently used, went.
        """
        raise NotImplementedError("task 13.route: see the docstring; `minillm hint 13 route` for hints")

    def on_replica_down(self, replica_id: int) -> None:
        self._seen.pop(replica_id, None)  # its cache died with it

    def num_remembered(self, replica_id: int) -> int:
        return len(self._seen.get(replica_id, ()))
