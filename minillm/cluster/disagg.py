"""Disaggregated prefill/decode (lesson 13): one process prefills, another decodes, the KV moves between them.

A long prefill in the decoding engine stalls every decode behind it; apart, each side is sized for its own work,
at the price of moving the KV: TTFT = queue + prefill + transfer (`stats()` splits it). `DisaggregatedLLM` is the
coordinator, with LLM's API; disagg_worker.py is the wire and both workers' loops.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from minillm.engine.output import StreamEvent
from minillm.request import RequestOutput, params_per_prompt, prompt_to_ids
from minillm.sampling import SamplingParams
from minillm.cluster.disagg_worker import (DECODE, ENGINE_KWARGS, PREFILL, _worker_main, recv_handoff,
                                           send_handoff)
from minillm.cluster.workers import PoolFrontEnd, raise_if_failed

SIDES = ("prefill", "decode")  # by rank (disagg_worker.PREFILL = 0, DECODE = 1), also their index in the pool
_LINK_GRACE_S = 5.0  # a dead prefill worker: how long to wait for the decode side's "link lost" (normally ms)

# ------------------------------------------------------------------------------------------ the coordinator


@dataclass
class _Tracked:
    """The coordinator's view of one request."""

    request_id: str
    submit_time: float
    last_progress: float
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)  # the text each token completes (StreamEvent.text)
    token_times: list[float] = field(default_factory=list)  # coordinator clock: when each token arrived
    finish_reason: str | None = None
    error: str | None = None
    on_decode: bool = False  # its KV reached the decode worker: the prefill worker is no longer needed
    info: dict = field(default_factory=dict)  # nbytes, t_send, t_recv, prefill time...

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return "".join(self.token_texts)


class DisaggregatedLLM(PoolFrontEnd):
    """A prefill worker and a decode worker (two spawned processes, each with its own minillm LLM and KV pool)
    behind LLM's API and result shapes: generate (RequestOutputs) / stream (StreamEvents) / submit + result /
    abort / serve / stats / close, prompts as text or ids (chat=True: the chat template), one SamplingParams or one
    per prompt. The KV crosses over gloo (CPU) or NCCL (GPU); tokens come back from the decode worker.

    A failure ends only the requests it strands, each with finish_reason "error" and metrics["error"] saying why,
    never a hang: a dead decode worker strands every unfinished request; a dead prefill worker only those whose KV
    had not reached the decode worker (the decode worker reports each handoff as it arrives, then the lost link),
    the others decode to the end."""

    def __init__(self, model="smollm2-135m", dtype: str = "float32", threads: int = 1,
                 prefill: dict | None = None, decode: dict | None = None, timeout_s: float = 120.0,
                 device: str = "cpu", decode_model=None, _fault: tuple[str, int] | None = None):
        """model: a name or {"tiny": {...}, "seed": s}; prefill / decode: LLM engine kwargs for each side
        (max_num_seqs, max_num_batched_tokens, num_blocks, block_size, kv_cache_dtype, ...); timeout_s: how
        long a request may go without progress (and startup may take) before it ends with an error.
        decode_model (default: model) exists to show the refusal of workers holding different weights.
        _fault (tests only): ("corrupt" | "die_mid_transfer", n) breaks the n-th handoff the prefill worker
        sends; ("unpack", 0) makes the decode worker fail while writing every KV payload; ("hold", n) makes the
        prefill worker stop stepping after n handoffs (the rest stay with it, for kill drills)."""
        from minillm.parallel.distributed import free_port

        sides = {"prefill": dict(prefill or {}), "decode": dict(decode or {})}
        for side, kw in sides.items():
            bad = sorted(set(kw) - set(ENGINE_KWARGS))
            if bad:
                raise TypeError(f"{side} engine kwargs {bad} unknown; use {list(ENGINE_KWARGS)}")
        for key, default in (("block_size", 16), ("kv_cache_dtype", None)):
            if sides["prefill"].get(key, default) != sides["decode"].get(key, default):
                raise ValueError(f"prefill {key}={sides['prefill'].get(key, default)!r} but decode "
                                 f"{key}={sides['decode'].get(key, default)!r}: the KV blocks must fit both "
                                 f"pools, give both sides the same {key}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' (gloo) or 'cuda' (NCCL, one GPU per worker), "
                             f"got {device!r}")
        self.timeout_s = float(timeout_s)
        self._ids = itertools.count()
        self._reqs: dict[str, _Tracked] = {}
        self._lock = threading.RLock()
        self.decode_free_blocks: int | None = None  # as the decode worker last reported it
        self.last_worker_error: str | None = None
        self._link_lost = False  # the decode worker's receiver lost the prefill worker: no handoff comes any more
        self._prefill_dead_since: float | None = None
        self._stats: list[dict] = []
        port = free_port()
        specs = {"prefill": model, "decode": model if decode_model is None else decode_model}
        args = [(rank, specs[side], dtype, threads, sides[side], port, device, _fault)
                for rank, side in enumerate(SIDES)]
        ready = self._start_workers(_worker_main, args, [f"the {side} worker" for side in SIDES], self.timeout_s,
                                    "the prefill and decode workers", check=self._check_layouts)
        self.processes = dict(zip(SIDES, self._workers.processes))
        self.info = dict(zip(SIDES, ready))
        self.decode_free_blocks = self.info["decode"]["num_blocks"]

    @staticmethod
    def _check_layouts(ready: list[dict]) -> None:
        p, d = ready
        for key in ("block_size", "kv_dtype", "layers", "kv_heads", "head_dim"):
            if p[key] != d[key]:
                raise ValueError(f"prefill and decode KV layouts differ in {key}: {p[key]} vs {d[key]}; the "
                                 f"KV blocks must fit both pools (same block_size and kv_cache_dtype on both "
                                 f"sides)")

    # ----------------------------------------------------------------------------------------- requests

    def _dead(self) -> list[str]:
        return [SIDES[i] for i in self._workers.dead()]

    def _check(self, prompt, params: SamplingParams | None) -> SamplingParams:
        """What can be refused here, before anything is sent: the params' type, token ids out of the vocabulary,
        empty prompts, text for workers without a tokenizer. Text is tokenized by the prefill worker."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str) and self.info["prefill"]["tokenizer"]:
            if not prompt.strip():
                raise ValueError("the prompt is empty: give some text or a non-empty list of token ids")
        else:
            prompt_to_ids(prompt, None, self.info["prefill"]["vocab_size"])
        return params

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, chat: bool = False) -> str:
        """Send one request (text, in the chat template when `chat`, or token ids) to the prefill worker; returns
        its id. A request refused by a worker, or stranded by a worker's death, ends with finish_reason "error"
        (see `result`)."""
        params = self._check(prompt, params)
        self._check_alive()
        return self._send(prompt, params, chat)

    def _check_alive(self) -> None:
        self._check_open()
        dead = self._dead()
        if dead:
            raise RuntimeError(f"no {' and no '.join(dead)} worker alive: start a new DisaggregatedLLM")

    def _send(self, prompt, params: SamplingParams, chat: bool) -> str:
        with self._lock:
            rid = str(next(self._ids))
            now = time.perf_counter()
            self._reqs[rid] = _Tracked(rid, now, now)
            self._workers.send(PREFILL, "add", rid, prompt, params, chat)  # if it just died: the next _pump says
            return rid

    def _submit_all(self, prompts, params, chat: bool) -> list[str]:
        """Check every request before sending any (like LLM.generate), then send them in order: once one is sent,
        each ends with its output or an error, whatever happens to the workers meanwhile."""
        params = params_per_prompt(prompts, params)
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                params[i] = self._check(prompt, p)
            except (ValueError, TypeError) as e:
                raise type(e)(f"request {i}: {e}") from None
        self._check_alive()
        return [self._send(prompt, p, chat) for prompt, p in zip(prompts, params)]

    def abort(self, request_id: str) -> bool:
        """Cancel a request in flight, on whichever worker holds it (finish_reason "abort"). False if it is not
        in flight."""
        with self._lock:
            r = self._reqs.get(str(request_id))
            if r is None or r.done:
                return False
            r.finish_reason = "abort"
            for side in (PREFILL, DECODE):
                self._workers.send(side, "abort", r.request_id)
            return True

    def _handle(self, ev: tuple) -> None:
        kind = ev[0]
        if kind == "free_blocks":
            self.decode_free_blocks = ev[1]
            return
        if kind in ("fatal", "link_lost"):
            self.last_worker_error = ev[-1]
            self._link_lost |= kind == "link_lost"
            return
        r = self._reqs.get(ev[1])
        if r is None or r.done:  # a late event of a request already ended here (aborted, failed)
            return
        now = time.perf_counter()
        r.last_progress = now
        if kind == "token":
            _, _, token, text, finished, reason = ev
            if token is not None:  # None: the end of an abort
                r.token_ids.append(token)
                r.token_texts.append(text)
                r.token_times.append(now)
            if finished:
                r.finish_reason = reason
        elif kind == "prefilled":
            r.prompt_ids = ev[2].pop("prompt_ids")
            r.info.update(nbytes=ev[2]["nbytes"], t_prefilled=ev[2]["t"])
        elif kind in ("sent", "arrived", "received"):
            r.info.update(ev[2])
            r.on_decode |= kind != "sent"
        elif kind == "error":
            if len(ev) > 3:
                self.decode_free_blocks = ev[3]["free_blocks"]
            self._fail(r, ev[2])

    def _fail(self, r: _Tracked, why: str) -> None:
        if not r.done:
            r.finish_reason, r.error = "error", why

    def _stranded(self, r: _Tracked, dead: list[str], now: float) -> str | None:
        """Why no live worker can finish request r any more, or None if one still can."""
        if "decode" in dead:
            return f"the decode worker died (exit code {self.processes['decode'].exitcode})"
        # a handoff may still be on the wire: stranded once the decode side lost the link (or, failing that, later)
        settled = self._link_lost or now - self._prefill_dead_since > min(self.timeout_s, _LINK_GRACE_S)
        if "prefill" in dead and not r.on_decode and settled:
            return (f"the prefill worker died (exit code {self.processes['prefill'].exitcode}) before the "
                    f"request's KV reached the decode worker")
        return None

    def _pump(self, timeout: float = 0.05) -> None:
        """Handle every event that has arrived (waiting up to `timeout` for the first); then fail the requests
        no live worker can finish any more, and those without progress for timeout_s."""
        with self._lock:
            for _, ev in self._workers.poll(timeout):
                self._handle(ev)
            dead = self._dead()
            now = time.perf_counter()
            if "prefill" in dead and self._prefill_dead_since is None:
                self._prefill_dead_since = now
            for r in self._reqs.values():
                if r.done:
                    continue
                why = self._stranded(r, dead, now) if dead else None
                if why is None and now - r.last_progress > self.timeout_s:
                    why = f"no progress for {self.timeout_s} s"
                if why is not None:
                    self._fail(r, why)

    def _output(self, rid: str) -> RequestOutput:
        r = self._reqs.pop(rid)
        t, n = r.token_times, len(r.token_times)
        nan = float("nan")
        # t_send / t_recv: time.perf_counter() in two processes, one clock on one machine (Linux)
        transfer_s = r.info["t_recv"] - r.info["t_send"] if "t_recv" in r.info and "t_send" in r.info else nan
        ttft = t[0] - r.submit_time if t else nan
        metrics = {"arrival_time": r.submit_time, "ttft": ttft,
                   "tpot": (t[-1] - t[0]) / (n - 1) if n > 1 else nan,
                   "itl": [b - a for a, b in zip(t, t[1:])], "e2e": (t[-1] if t else nan) - r.submit_time,
                   "queue_time": nan, "num_preemptions": 0, "transfer_bytes": r.info.get("nbytes", 0),
                   "transfer_s": transfer_s, "transfer_share_of_ttft": transfer_s / ttft if t else nan,
                   "error": r.error}
        self._stats.append({"request_id": rid, "prompt_tokens": len(r.prompt_ids), "ttft_s": ttft,
                            "transfer_bytes": metrics["transfer_bytes"], "transfer_s": transfer_s,
                            "transfer_share_of_ttft": metrics["transfer_share_of_ttft"], "error": r.error})
        return RequestOutput(rid, r.prompt_ids, r.token_ids, r.text, r.finish_reason, metrics,
                             [x - r.submit_time for x in t])

    def result(self, rid: str) -> RequestOutput:
        """Wait for one request (or its error: finish_reason "error", metrics["error"] the reason); pop its
        output."""
        while not self._reqs[rid].done:
            self._pump()
        return self._output(rid)

    def generate(self, prompts: list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None, chat: bool = False,
                 raise_on_error: bool = True) -> list[RequestOutput]:
        """Run every prompt (text, in the chat template when `chat`, or token ids) to completion; outputs in
        input order, as LLM.generate's. A request that failed raises RuntimeError naming it (after the others
        finished), unless raise_on_error=False (then its finish_reason is "error", metrics["error"] why)."""
        ids = self._submit_all(prompts, params, chat)
        outs = [self.result(r) for r in ids]
        if raise_on_error:
            raise_if_failed(outs)
        return outs

    def stream(self, prompts: list[str | list[int]],
               params: SamplingParams | list[SamplingParams] | None = None,
               chat: bool = False) -> Iterator[StreamEvent]:
        """Yield each token as it arrives, prompts interleaved, as LLM.stream's StreamEvents. A request that fails
        ends with StreamEvent(id, None, "", True, "error") (stats() names why), an aborted one with "abort".
        Stopping the iteration early aborts the requests still in flight."""
        ids = self._submit_all(prompts, params, chat)
        seen = dict.fromkeys(ids, 0)  # request id -> tokens yielded, while it has not ended
        try:
            while seen:
                self._pump()
                for rid in list(seen):
                    r = self._reqs[rid]
                    ended = r.done and r.finish_reason in ("stop", "length")  # its last token carries the end
                    n = len(r.token_ids)
                    events = [StreamEvent(rid, r.token_ids[k], r.token_texts[k], ended and k == n - 1,
                                          r.finish_reason if ended and k == n - 1 else None)
                              for k in range(seen[rid], n)]
                    seen[rid] = n
                    if r.done:
                        if not ended:
                            events.append(StreamEvent(rid, None, "", True, r.finish_reason))
                        del seen[rid]
                        self._output(rid)
                    yield from events
        finally:  # the caller stopped early: nothing of its requests keeps running or piles up here
            with self._lock:
                for rid in seen:
                    self.abort(rid)
                    self._output(rid)

    def serve(self, requests) -> tuple[list[RequestOutput], float]:
        """Feed minillm.measure.workload Requests at their arrival times (like workload.serve); (outputs, wall
        seconds)."""
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time)
        ids: dict[int, str] = {}
        t0, nxt = time.perf_counter(), 0
        while nxt < len(order) or any(not self._reqs[r].done for r in ids.values()):
            while nxt < len(order) and requests[order[nxt]].arrival_time <= time.perf_counter() - t0:
                r = requests[order[nxt]]
                ids[order[nxt]] = self.submit(r.prompt_ids, r.params())
                nxt += 1
            wait = requests[order[nxt]].arrival_time + t0 - time.perf_counter() if nxt < len(order) else 0.05
            self._pump(min(0.05, max(0.0, wait)))
        wall = time.perf_counter() - t0
        return [self._output(ids[i]) for i in range(len(requests))], wall

    def stats(self) -> dict:
        """Per finished request: prompt tokens, TTFT, KV bytes moved, transfer seconds and share of TTFT."""
        return {"requests": list(self._stats), "decode_free_blocks": self.decode_free_blocks,
                "workers": {s: p.is_alive() for s, p in self.processes.items()}}


__all__ = ["DisaggregatedLLM", "recv_handoff", "send_handoff"]
