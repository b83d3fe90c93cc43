"""A pool of engine replicas behind a router (lesson 13): N processes, each its own LLM with prefix caching.

One engine saturates its cores; N replicas serve N times the load, and a router that sends a prompt where its prefix
is already cached keeps the prefix cache's saving across them. `ReplicaPool` is a cluster/workers.py front end
running replica_worker.py; router.py picks each request's replica.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

from minillm.cache.block_allocator import blocks_needed
from minillm.engine.output import StreamEvent
from minillm.request import RequestOutput, make_request, params_per_prompt, prompt_to_ids
from minillm.sampling import SamplingParams
from minillm.cluster.replica_worker import Fault, _replica_main
from minillm.cluster.router import ReplicaState, Router, make_router
from minillm.cluster.workers import PoolFrontEnd, raise_if_failed

# ------------------------------------------------------------------------------------------------ the pool


@dataclass
class _Job:
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    attempts: int = 0
    replica: int = -1
    rid: str = ""
    base: int = 0  # tokens out before this attempt: a retry continues after them
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class ReplicaPool(PoolFrontEnd):
    """N engine replicas (processes) behind a router. `model`: a name or a load_spec spec (or a list, one per
    replica); `policy`: "round_robin" | "least_tokens" | "prefix_affinity" | a Router; `engine_kwargs`: for
    LLM.from_model (num_blocks, block_size, max_num_seqs, ...); `timeout`: seconds a request may take from
    arrival (also the startup limit); `faults`: {replica: Fault} for tests. One generate or stream at a time.

    Each request is timed on the pool's clock from its arrival (what a client sees) and its metrics say where it
    ran ("replica", "attempts", "prefix_cache"); `stats()` has each replica's prefix-cache counters. Replicas with
    different weights are refused at startup; a slow one delays, never drops; a dead one's requests continue on a
    live replica where they stopped (prompt + the tokens already out, prefilled again; at most `max_attempts`
    replicas each). A request never vanishes: it ends with its output or with finish_reason "error" and
    metrics["error"] saying why (no live replica left, a timeout, a refusal)."""

    def __init__(self, model="smollm2-135m", n_replicas: int = 2, policy: str | Router = "prefix_affinity",
                 engine_kwargs: dict | None = None, threads: int = 1, timeout: float = 300.0,
                 dtype: str = "float32", max_attempts: int | None = None,
                 faults: dict[int, Fault] | None = None):
        if not isinstance(n_replicas, int) or n_replicas < 1:
            raise ValueError(f"n_replicas must be an integer >= 1, got {n_replicas!r}")
        specs = model if isinstance(model, list) else [model] * n_replicas
        if len(specs) != n_replicas:
            raise ValueError(f"got {len(specs)} model specs for {n_replicas} replicas: give one, or one per "
                             f"replica")
        if timeout <= 0 or threads < 1:
            raise ValueError(f"need timeout > 0 and threads >= 1, got {timeout}, {threads}")
        self.policy, self.timeout = policy, timeout
        self.max_attempts = max_attempts or n_replicas
        self.replicas = [ReplicaState(i) for i in range(n_replicas)]
        self._spec = specs[0]  # all hold the same weights (checked below): its tokenizer is theirs
        self._tokenizer = None
        self._busy = False
        self._exit_why: dict[int, str] = {}
        self._call, self._active = 0, {}
        ready = self._start_workers(_replica_main, [(i, spec, dtype, dict(engine_kwargs or {}), threads,
                                                     (faults or {}).get(i)) for i, spec in enumerate(specs)],
                                    [f"replica {i}" for i in range(n_replicas)], timeout, "replicas")
        self._procs = self._workers.processes
        self.num_blocks, self.block_size = ready[0]["num_blocks"], ready[0]["block_size"]
        self._config = SimpleNamespace(vocab_size=ready[0]["vocab_size"], max_seq_len=ready[0]["max_seq_len"])
        self.router = make_router(policy, self.block_size, self.num_blocks)
        self._reset_counters()

    # --------------------------------------------------------------------------------------------- plumbing

    def _reset_counters(self) -> None:
        self._requests = [0] * len(self.replicas)
        self._tokens = [0] * len(self.replicas)
        self._cache_stats: list[dict | None] = [None] * len(self.replicas)

    def reset(self, policy: str | Router | None = None) -> None:
        """Empty every live replica's KV cache (a fresh engine over the same weights), zero the stats, and
        start a fresh router (`policy`, or the current one): policies compared in turn start equal."""
        sent = [r.id for r in self.replicas if r.alive and self._workers.send(r.id, "reset")]
        # late events of requests given up may come first: skipped
        self._workers.expect("reset_done", self.timeout, sent, skip=("event", "rejected"))
        self.policy = self.policy if policy is None else policy
        self.router = make_router(self.policy, self.block_size, self.num_blocks)
        self._reset_counters()

    @property
    def tokenizer(self):
        """The replicas' tokenizer, loaded here (without the weights) the first time a prompt is text; None for
        a tiny random model without one."""
        if self._tokenizer is None:
            from minillm.gguf.loader import describe_spec

            self._tokenizer = describe_spec(self._spec)[1]
        return self._tokenizer

    # --------------------------------------------------------------------------------------------- generate

    def generate(self, prompts: list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None, chat: bool = False,
                 arrival_times: list[float] | None = None, raise_on_error: bool = True) -> list[RequestOutput]:
        """Run the prompts (text, in the chat template when `chat`, or token ids) on the replicas; each is sent
        when its arrival time (seconds after the call) comes. Outputs in input order, as LLM.generate's. A request
        that failed raises RuntimeError naming it (after the others ended), unless raise_on_error=False (then
        its finish_reason is "error", metrics["error"] why)."""
        jobs = self._jobs(prompts, params, chat, arrival_times)
        for _ in self._serve(jobs):
            pass
        outs = [self._results[j.index] for j in jobs]
        if raise_on_error:
            raise_if_failed(outs)
        return outs

    def stream(self, prompts: list[str | list[int]],
               params: SamplingParams | list[SamplingParams] | None = None, chat: bool = False,
               arrival_times: list[float] | None = None) -> Iterator[StreamEvent]:
        """generate's requests, yielded token by token as LLM.stream's StreamEvents (request ids: the prompts'
        indices). A request that fails ends with StreamEvent(id, None, "", True, "error"); one moved to another
        replica goes on where it stopped (no token twice). Stopping early aborts what is in flight."""
        yield from self._serve(self._jobs(prompts, params, chat, arrival_times))

    def _jobs(self, prompts, params, chat: bool, arrival_times) -> list[_Job]:
        """Check every request here, with the engine's own checks, so a bad one fails the call before anything
        is sent; text becomes ids here (the router hashes ids)."""
        self._check_open()
        params = params_per_prompt(prompts, params)
        arrival_times = [0.0] * len(prompts) if arrival_times is None else list(arrival_times)
        if len(arrival_times) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts and {len(arrival_times)} arrival times")
        t0 = time.perf_counter()
        jobs = []
        for i, (p, sp, a) in enumerate(zip(prompts, params, arrival_times)):
            try:
                ids = prompt_to_ids(p, self.tokenizer if isinstance(p, str) else None, self._config.vocab_size,
                                    chat)
                make_request(ids, sp, None, self._config)
                if sp.max_tokens < 1 or not a >= 0:
                    raise ValueError(f"need max_tokens >= 1 and an arrival time >= 0, got {sp.max_tokens}, "
                                     f"{a}")
                if blocks_needed(len(ids) + sp.max_tokens - 1, self.block_size) > self.num_blocks:
                    raise ValueError(f"prompt + max_tokens need more KV blocks than a replica has "
                                     f"({self.num_blocks} x {self.block_size} tokens): lower max_tokens or "
                                     f"give the replicas more")
            except (ValueError, TypeError) as e:
                raise type(e)(f"request {i}: {e}") from None
            jobs.append(_Job(i, ids, sp, t0 + a))
        return jobs

    def _serve(self, jobs: list[_Job]) -> Iterator[StreamEvent]:
        """The pool's loop: dispatch each job when it arrives, hand over what the replicas send, move the
        requests of a dead replica, time out the late ones; yield the StreamEvents as they come."""
        if self._busy:
            raise RuntimeError("this ReplicaPool is already serving a generate or stream: one at a time")
        self._busy = True
        pending = deque(sorted(jobs, key=lambda j: j.arrival))
        self._call += 1
        self._active: dict[str, _Job] = {}
        self._results: dict[int, RequestOutput] = {}
        self._events: list[StreamEvent] = []
        try:
            while len(self._results) < len(jobs):
                now = time.perf_counter()
                while pending and pending[0].arrival <= now:
                    self._dispatch(pending.popleft())
                for job in [j for j in self._active.values() if now - j.arrival > self.timeout]:
                    self._workers.send(job.replica, "abort", job.rid)
                    self._end(job, f"timed out after {self.timeout:.0f} s on replica {job.replica}")
                wait_s = min(0.05, max(0.0, pending[0].arrival - now)) if pending else 0.05
                live_ids = [r.id for r in self.replicas if r.alive]
                for i, msg in self._workers.poll(wait_s, live_ids):
                    self._handle(i, *msg)
                for i in self._workers.dead(live_ids):
                    self._down(i, f"replica {i} exited with code {self._workers.exitcode(i)}")
                if not any(r.alive for r in self.replicas):  # the queued ones end now, not at their arrival
                    while pending:
                        self._dispatch(pending.popleft())
                events, self._events = self._events, []
                yield from events
        finally:  # an error or a stream left early ends the call: what is in flight is aborted, not left running
            for job in list(self._active.values()):
                self._workers.send(job.replica, "abort", job.rid)
                self.replicas[job.replica].on_finish(job.rid)
            self._active = {}
            self._busy = False

    def _dispatch(self, job: _Job) -> None:
        """Route and send one job (a retried one: its prompt + the tokens already out, for the tokens left); a
        replica that cannot take it is marked down and the job routed again. No live replica: it ends with an
        error."""
        job.base = len(job.tokens)
        sent = job.prompt_ids + job.tokens
        params = dataclasses.replace(job.params, max_tokens=job.params.max_tokens - job.base)
        try:
            i = self.router.choose(sent, params.max_tokens, self.replicas)
        except RuntimeError as e:
            self._end(job, f"{e} ({'; '.join(self._exit_why.values()) or 'no replica'})", active=False)
            return
        # a new id per call and attempt: late events of an attempt given up are recognised and ignored
        job.replica, job.rid = i, f"{self._call}.{job.index}.{job.attempts}"
        job.attempts += 1
        self.replicas[i].on_dispatch(job.rid, len(sent), params.max_tokens)
        self.router.on_dispatch(i, sent)
        self._active[job.rid] = job
        if not self._workers.send(i, "add", job.rid, sent, params):
            self._down(i, f"replica {i}'s command pipe is closed")  # which sends this job elsewhere too

    def _handle(self, i: int, kind: str, *args) -> None:
        if kind in ("failed", "fatal"):
            self._down(i, f"replica {i} failed: {args[-1]}")
            return
        rid = args[0]
        job = self._active.get(rid)
        if job is None:  # an event of an attempt that was already given up
            return
        if kind == "rejected":
            self._end(job, f"replica {i} refused it: {args[1]}")
            return
        _, token, text, finished, reason, stats = args
        if token is not None:
            job.tokens.append(token), job.times.append(time.perf_counter()), job.text.append(text)
            self.replicas[i].on_progress(rid, len(job.tokens) - job.base)
        done = finished and reason != "abort"  # an abort not asked for by the pool: the replica gave up on it
        if token is not None:
            self._events.append(StreamEvent(str(job.index), token, text, done, reason if done else None))
        if finished and not done:
            self._retry(job, f"replica {i} aborted it")
        elif done:
            self._cache_stats[i] = stats
            self._requests[i] += 1
            self._tokens[i] += len(job.tokens) - job.base
            self._end(job, None, reason, stats)

    def _down(self, i: int, why: str) -> None:
        """Replica i is gone: stop routing to it, move its in-flight requests elsewhere."""
        r = self.replicas[i]
        if not r.alive:
            return
        r.alive = False
        self._exit_why[i] = why
        self.router.on_replica_down(i)
        for rid in list(r.in_flight):
            if rid in self._active:
                self._retry(self._active[rid], why)
        r.in_flight.clear()

    def _retry(self, job: _Job, why: str) -> None:
        job.errors.append(why)
        self.replicas[job.replica].on_finish(job.rid)
        del self._active[job.rid]
        if job.attempts >= self.max_attempts:
            self._end(job, f"failed on {job.attempts} replica(s): {'; '.join(job.errors)}", active=False)
        else:
            self._dispatch(job)

    def _end(self, job: _Job, error: str | None, reason: str | None = "error", stats: dict | None = None,
             active: bool = True) -> None:
        if active:
            self.replicas[job.replica].on_finish(job.rid)
            del self._active[job.rid]
        if error is not None:
            self._events.append(StreamEvent(str(job.index), None, "", True, "error"))
        rel = [t - job.arrival for t in job.times]
        n = len(rel)
        metrics = {"arrival_time": job.arrival, "ttft": rel[0] if n else float("nan"),
                   "tpot": (rel[-1] - rel[0]) / (n - 1) if n > 1 else float("nan"),
                   "e2e": rel[-1] if n and error is None else float("nan"),
                   "itl": [b - a for a, b in itertools.pairwise(rel)],
                   "replica": job.replica, "attempts": job.attempts, "error": error, "prefix_cache": stats}
        self._results[job.index] = RequestOutput(str(job.index), job.prompt_ids, list(job.tokens),
                                                 "".join(job.text), reason, metrics, rel)

    # ------------------------------------------------------------------------------------------------ stats

    def stats(self) -> list[dict]:
        """Per replica since the last reset: alive, requests finished, output tokens, prefix-cache hit
        rate."""
        return [{"replica": r.id, "alive": r.alive, "requests": self._requests[r.id],
                 "tokens": self._tokens[r.id],
                 "hit_rate": (self._cache_stats[r.id] or {}).get("hit_rate", 0.0),
                 "prefix_cache": self._cache_stats[r.id]} for r in self.replicas]


__all__ = ["Fault", "ReplicaPool"]
