"""Routing across engine replicas: round-robin, least outstanding tokens, prefix affinity (lesson 13).

Load is a replica's outstanding tokens (prompt not yet prefilled + output still to generate), not its request
count. Prefix affinity (SGLang's cache-aware router) remembers per replica the block hashes of the prompts
sent there (the engine's chain, LRU-bounded) and picks the longest match, or the least loaded replica when the
load gap is too large. It never sees the caches: a wrong guess costs a prefill, never a wrong answer. Pure
logic (cluster/replicas.py runs the replicas). Exercise 13 asks for `least_loaded` and four
PrefixAffinityRouter methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from minillm.cache.prefix_cache import block_hashes


@dataclass
class RequestLoad:
    """What one in-flight request still costs its replica."""

    prompt_tokens: int
    max_tokens: int
    prefilled: int = 0  # prompt tokens already computed (all of them once the first output token exists)
    generated: int = 0  # output tokens already sampled

    @property
    def outstanding_tokens(self) -> int:
        return (self.prompt_tokens - self.prefilled) + (self.max_tokens - self.generated)


@dataclass
class ReplicaState:
    """The router's view of one replica: is it alive, and what is in flight on it."""

    id: int
    alive: bool = True
    in_flight: dict[str, RequestLoad] = field(default_factory=dict)  # request id -> its load

    @property
    def outstanding_tokens(self) -> int:
        return sum(r.outstanding_tokens for r in self.in_flight.values())

    @property
    def num_in_flight(self) -> int:
        return len(self.in_flight)

    # bookkeeping, called by whoever sends the requests (ReplicaPool)
    def on_dispatch(self, request_id: str, prompt_tokens: int, max_tokens: int) -> None:
        self.in_flight[request_id] = RequestLoad(prompt_tokens, max_tokens)

    def on_progress(self, request_id: str, generated: int, prefilled: int | None = None) -> None:
        """`generated` output tokens exist; the prompt is fully prefilled unless `prefilled` says otherwise."""
        load = self.in_flight[request_id]
        load.generated = generated
        load.prefilled = load.prompt_tokens if prefilled is None else prefilled

    def on_finish(self, request_id: str) -> RequestLoad | None:
        return self.in_flight.pop(request_id, None)


def live(replicas: Sequence[ReplicaState]) -> list[ReplicaState]:
    """The replicas a request may go to; RuntimeError if there is none (a request is never dropped silently)."""
    alive = [r for r in replicas if r.alive]
    if not alive:
        raise RuntimeError(f"no live replica to route to ({len(replicas)} replica(s), all down): restart the pool")
    return alive


def least_loaded(replicas: Sequence[ReplicaState]) -> ReplicaState:
    """The live replica with the fewest outstanding tokens (ties: the lowest id)."""
    return min(live(replicas), key=lambda r: (r.outstanding_tokens, r.id))


class Router(ABC):
    """A routing policy. `choose` picks a live replica's id; `on_dispatch` tells the router where a request went."""

    name = "router"

    @abstractmethod
    def choose(self, prompt_ids: Sequence[int], max_tokens: int, replicas: Sequence[ReplicaState]) -> int:
        """The id of the live replica this request goes to."""

    def on_dispatch(self, replica_id: int, prompt_ids: Sequence[int]) -> None:
        pass

    def on_replica_down(self, replica_id: int) -> None:
        pass


class RoundRobinRouter(Router):
    """Each live replica in turn, whatever it holds or owes: the baseline."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0  # the id to try first next time

    def choose(self, prompt_ids, max_tokens, replicas) -> int:
        ids = sorted(r.id for r in live(replicas))
        pick = next((i for i in ids if i >= self._next), ids[0])  # the next live id, wrapping around
        self._next = pick + 1
        return pick


class LeastOutstandingTokensRouter(Router):
    """The live replica that owes the fewest tokens of work (ties: the lowest id)."""

    name = "least_tokens"

    def choose(self, prompt_ids, max_tokens, replicas) -> int:
        return least_loaded(replicas).id


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


POLICIES = {"round_robin": RoundRobinRouter, "least_tokens": LeastOutstandingTokensRouter,
            "prefix_affinity": PrefixAffinityRouter}


def make_router(policy: str | Router, block_size: int = 16, max_blocks: int = 4096) -> Router:
    """A router by name ("round_robin", "least_tokens", "prefix_affinity"), or the Router given."""
    if isinstance(policy, Router):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"unknown routing policy {policy!r}: choose one of {sorted(POLICIES)} or pass a Router")
    if policy == "prefix_affinity":
        return PrefixAffinityRouter(block_size, max_blocks)
    return POLICIES[policy]()


__all__ = [
    "POLICIES",
    "LeastOutstandingTokensRouter",
    "PrefixAffinityRouter",
    "ReplicaState",
    "RequestLoad",
    "RoundRobinRouter",
    "Router",
    "least_loaded",
    "live",
    "make_router",
]
