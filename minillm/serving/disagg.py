"""Disaggregated prefill/decode: one process prefills, another decodes, the KV cache moves between them (lesson 13).

In one engine, prefill (compute bound: a whole prompt per forward) and decode (memory bound: one token per sequence)
share every step, so a long prompt arriving stalls every running decode for its whole prefill (chunked prefill only
bounds the stall). DistServe, Splitwise and vLLM's disaggregated prefill put them on different workers:

    coordinator (this process)  --requests-->  prefill worker (rank 0, its own LLM + KV pool)
                                                   | add_prefill: prompt -> KV blocks + first token -> KVHandoff
                                                   | torch.distributed send: header, then the KV tensors
                                                   v
    coordinator  <--tokens/events--  decode worker (rank 1, its own LLM + KV pool)
                                        a receiver thread; add_prefilled: own blocks, unpack, keep decoding

Control travels over multiprocessing queues (plain Python objects); the KV over a gloo (CPU) / NCCL (GPU) process
group: a length, a pickled header, then each tensor with send/recv. The workers' side (the wire and both loops) is
minillm/serving/disagg_worker.py; this file is the coordinator. The decode worker's pool never waits for a
transfer: it allocates blocks only when a payload has fully arrived (and gives them back if writing it fails), and
queues handoffs it has no room for until decodes finish. The first token reaches the caller from the decode worker,
after its KV landed, so TTFT = queue + prefill + transfer; `stats()` gives each request's transfer bytes, seconds
and share of TTFT. Every wait has a timeout: a worker that dies ends its requests with an error, not a hang.
Times are time.perf_counter() of one machine (the same clock in every process on Linux).

    with DisaggregatedLLM("smollm2-135m", threads=1, prefill={"max_num_batched_tokens": 256}) as llm:
        outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))

The colocated baseline for a benchmark is one minillm.LLM given both cores (workload.serve); `serve` here feeds a
workload the same way (requests submitted at their arrival times).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass, field

from minillm.serving.disagg_worker import DECODE, ENGINE_KWARGS, PREFILL, _worker_main, recv_handoff, send_handoff  # noqa: F401
from minillm.request import RequestOutput, params_per_prompt
from minillm.sampling import SamplingParams

# ---------------------------------------------------------------------------------------------- the coordinator


@dataclass
class _Tracked:
    """The coordinator's view of one request."""

    request_id: str
    submit_time: float
    last_progress: float
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # coordinator clock, when each token event arrived
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    info: dict = field(default_factory=dict)  # nbytes, t_send, t_recv, prefill time...

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class DisaggregatedLLM:
    """A prefill worker and a decode worker (two spawned processes, each with its own minillm LLM and KV pool)
    behind an LLM-like API: generate / submit / stream / stats / close."""

    def __init__(self, model="smollm2-135m", dtype: str = "float32", threads: int = 1, prefill: dict | None = None,
                 decode: dict | None = None, timeout_s: float = 120.0, device: str = "cpu", decode_model=None,
                 _fault: tuple[str, int] | None = None):
        """model: a name or {"tiny": {...}, "seed": s}; prefill / decode: LLM engine kwargs for each side
        (max_num_seqs, max_num_batched_tokens, num_blocks, block_size, kv_cache_dtype, ...); timeout_s: how long
        a request may go without progress (and startup may take) before it ends with an error. decode_model
        (default: model) exists to show the refusal of workers holding different weights. _fault (tests only):
        ("corrupt" | "die_mid_transfer", n) breaks the n-th handoff the prefill worker sends; ("unpack", 0) makes
        the decode worker fail while writing every KV payload."""
        import torch.multiprocessing as mp

        from minillm.parallel.distributed import free_port, without_main_reimport

        sides = {"prefill": dict(prefill or {}), "decode": dict(decode or {})}
        for side, kw in sides.items():
            bad = sorted(set(kw) - set(ENGINE_KWARGS))
            if bad:
                raise TypeError(f"{side} engine kwargs {bad} unknown; use {list(ENGINE_KWARGS)}")
        for key, default in (("block_size", 16), ("kv_cache_dtype", None)):
            if sides["prefill"].get(key, default) != sides["decode"].get(key, default):
                raise ValueError(f"prefill {key}={sides['prefill'].get(key, default)!r} but decode "
                                 f"{key}={sides['decode'].get(key, default)!r}: the KV blocks must fit both pools, "
                                 f"give both sides the same {key}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' (gloo) or 'cuda' (NCCL, one GPU per worker), got {device!r}")
        self.timeout_s = float(timeout_s)
        self._ids = itertools.count()
        self._reqs: dict[str, _Tracked] = {}
        self._lock = threading.RLock()
        self.decode_free_blocks: int | None = None  # as the decode worker last reported it
        self.last_worker_error: str | None = None
        self._stats: list[dict] = []
        ctx = mp.get_context("spawn")
        self._events = ctx.Queue()
        self._inboxes = {"prefill": ctx.Queue(), "decode": ctx.Queue()}
        port = free_port()
        self.processes = {}
        for rank, side in ((PREFILL, "prefill"), (DECODE, "decode")):
            spec = decode_model if side == "decode" and decode_model is not None else model
            self.processes[side] = ctx.Process(
                target=_worker_main, name=f"minillm-{side}", daemon=True,
                args=(rank, spec, dtype, threads, sides[side], port, device, self._inboxes[side], self._events,
                      _fault))
        self._closed = False
        try:
            with without_main_reimport():
                for p in self.processes.values():
                    p.start()
            self.info = self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> dict:
        ready: dict = {}
        deadline = time.perf_counter() + self.timeout_s
        while len(ready) < 2:
            try:
                ev = self._events.get(timeout=0.1)
            except queue.Empty:
                dead = [s for s, p in self.processes.items() if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"the {dead[0]} worker exited during startup (code "
                                       f"{self.processes[dead[0]].exitcode})") from None
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"the workers did not start within {self.timeout_s} s") from None
                continue
            if ev[0] == "fatal":
                raise RuntimeError(f"the {ev[1]} worker failed to start:\n{ev[2]}")
            if ev[0] == "ready":
                ready[ev[1]] = ev[2]
        p, d = ready["prefill"], ready["decode"]
        if p["checksum"] != d["checksum"]:
            raise RuntimeError(f"the prefill and decode workers loaded different weights (checksums {p['checksum']} "
                               f"and {d['checksum']}): both must load the same model file with the same dtype")
        for key in ("block_size", "kv_dtype", "layers", "kv_heads", "head_dim"):
            if p[key] != d[key]:
                raise ValueError(f"prefill and decode KV layouts differ in {key}: {p[key]} vs {d[key]}; the KV "
                                 f"blocks must fit both pools (same block_size and kv_cache_dtype on both sides)")
        self.decode_free_blocks = d["num_blocks"]
        return ready

    # --------------------------------------------------------------------------------------------- requests

    def _dead(self) -> list[str]:
        return [s for s, p in self.processes.items() if not p.is_alive()]

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None) -> str:
        """Send one request to the prefill worker; returns its id. A request refused by a worker, or in flight
        when a worker dies, ends with finish_reason "error" (see `result`)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if self._closed:
            raise RuntimeError("this DisaggregatedLLM is closed")
        dead = self._dead()
        if dead:
            raise RuntimeError(f"no {' and no '.join(dead)} worker alive: start a new DisaggregatedLLM")
        with self._lock:
            rid = str(next(self._ids))
            now = time.perf_counter()
            self._reqs[rid] = _Tracked(rid, now, now)
            self._inboxes["prefill"].put(("add", rid, prompt, params))
            return rid

    def _handle(self, ev: tuple) -> None:
        kind = ev[0]
        if kind == "free_blocks":
            self.decode_free_blocks = ev[1]
            return
        if kind in ("fatal", "link_lost"):
            self.last_worker_error = ev[2]
            return
        r = self._reqs.get(ev[1])
        if r is None:
            return
        now = time.perf_counter()
        r.last_progress = now
        if kind == "token":
            _, _, token, text, finished, reason = ev
            r.token_ids.append(token)
            r.token_times.append(now)
            r.text += text
            if finished:
                r.finish_reason = reason
        elif kind == "prefilled":
            r.prompt_ids = ev[2].pop("prompt_ids")
            r.info.update(nbytes=ev[2]["nbytes"], t_prefilled=ev[2]["t"])
        elif kind in ("sent", "received"):
            r.info.update(ev[2])
        elif kind == "error":
            if len(ev) > 3:
                self.decode_free_blocks = ev[3]["free_blocks"]
            self._fail(r, ev[2])

    def _fail(self, r: _Tracked, why: str) -> None:
        if not r.done:
            r.finish_reason, r.error = "error", why

    def _pump(self, timeout: float = 0.05) -> None:
        """Handle every event that has arrived (waiting up to `timeout` for the first); then fail the requests no
        worker can finish any more."""
        with self._lock:
            try:
                ev = self._events.get(timeout=timeout)
                while True:
                    self._handle(ev)
                    ev = self._events.get_nowait()
            except queue.Empty:
                pass
            dead = self._dead()
            now = time.perf_counter()
            for r in self._reqs.values():
                if r.done:
                    continue
                if dead:
                    codes = ", ".join(f"{s} (exit code {self.processes[s].exitcode})" for s in dead)
                    self._fail(r, f"request {r.request_id}: the worker process died: {codes}")
                elif now - r.last_progress > self.timeout_s:
                    self._fail(r, f"request {r.request_id}: no progress for {self.timeout_s} s")

    def _output(self, rid: str) -> RequestOutput:
        r = self._reqs.pop(rid)
        t, n = r.token_times, len(r.token_times)
        nan = float("nan")
        transfer_s = r.info["t_recv"] - r.info["t_send"] if "t_recv" in r.info and "t_send" in r.info else nan
        ttft = t[0] - r.submit_time if t else nan
        metrics = {"arrival_time": r.submit_time, "ttft": ttft, "tpot": (t[-1] - t[0]) / (n - 1) if n > 1 else nan,
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
        """Wait for one request (or its error: finish_reason "error", metrics["error"] the reason); pop its output."""
        while not self._reqs[rid].done:
            self._pump()
        return self._output(rid)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 raise_on_error: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in input order. A request that failed raises RuntimeError naming
        it (after the others finished), unless raise_on_error=False (then its finish_reason is "error")."""
        params = params_per_prompt(prompts, params)
        ids = [self.submit(p, sp) for p, sp in zip(prompts, params)]
        outs = [self.result(r) for r in ids]
        failed = [(o.request_id, o.metrics["error"]) for o in outs if o.finish_reason == "error"]
        if failed and raise_on_error:
            raise RuntimeError(f"{len(failed)} of {len(outs)} requests failed: "
                               + "; ".join(f"{r}: {why}" for r, why in failed))
        return outs

    def stream(self, prompts: list[str | list[int]], params: SamplingParams | None = None):
        """Yield (request_id, token_id, finished, finish_reason) as tokens arrive, interleaved across prompts."""
        ids = [self.submit(p, params) for p in prompts]
        seen = {r: 0 for r in ids}
        while seen:
            self._pump()
            for rid in list(seen):
                r = self._reqs[rid]
                for tok in r.token_ids[seen[rid]:]:
                    seen[rid] += 1
                    yield rid, tok, r.done and seen[rid] == len(r.token_ids), r.finish_reason
                if r.done:
                    if r.error is not None:
                        yield rid, None, True, "error"
                    del seen[rid]
                    self._output(rid)

    def serve(self, requests) -> tuple[list[RequestOutput], float]:
        """Feed minillm.bench.workload Requests at their arrival times (like workload.serve); (outputs, wall seconds)."""
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time)
        ids: dict[int, str] = {}
        t0, nxt = time.perf_counter(), 0
        while nxt < len(order) or any(not self._reqs[r].done for r in ids.values()):
            while nxt < len(order) and requests[order[nxt]].arrival_time <= time.perf_counter() - t0:
                r = requests[order[nxt]]
                ids[order[nxt]] = self.submit(r.prompt_ids, r.params())
                nxt += 1
            wait = requests[order[nxt]].arrival_time - (time.perf_counter() - t0) if nxt < len(order) else 0.05
            self._pump(min(0.05, max(0.0, wait)))
        wall = time.perf_counter() - t0
        return [self._output(ids[i]) for i in range(len(requests))], wall

    def stats(self) -> dict:
        """Per finished request: prompt tokens, TTFT, KV bytes moved, transfer seconds and their share of TTFT."""
        return {"requests": list(self._stats), "decode_free_blocks": self.decode_free_blocks,
                "workers": {s: p.is_alive() for s, p in self.processes.items()}}

    # ------------------------------------------------------------------------------------------------ close

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop both workers (politely, then terminate/kill); safe to call twice."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for side in ("prefill", "decode"):
            if self.processes[side].is_alive():
                self._inboxes[side].put(("stop",))
        deadline = time.perf_counter() + timeout_s
        for p in self.processes.values():
            if p.pid is not None:
                p.join(max(0.1, deadline - time.perf_counter()))
        for p in self.processes.values():
            if p.is_alive():
                p.terminate()
                p.join(2)
            if p.is_alive():
                p.kill()
                p.join(2)
        for q in (self._events, *self._inboxes.values()):
            q.cancel_join_thread()
            q.close()

    def __enter__(self) -> DisaggregatedLLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close(timeout_s=1.0)
        except Exception:
            pass


__all__ = ["DisaggregatedLLM", "recv_handoff", "send_handoff"]
