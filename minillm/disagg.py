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
group: a length, a pickled header, then each tensor with send/recv. The decode worker's pool never waits for a
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
import os
import pickle
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .kv_transfer import KVHandoff
from .request import RequestOutput
from .sampling import SamplingParams

PREFILL, DECODE = 0, 1  # ranks
ENGINE_KWARGS = ("num_blocks", "kv_cache_bytes", "block_size", "max_num_seqs", "max_num_batched_tokens",
                 "kv_cache_dtype", "enable_prefix_caching")
_GROUP_TIMEOUT_S = 24 * 3600  # the receiver waits idle for the next handoff; liveness is the coordinator's job

# ------------------------------------------------------------------------------------------------------ the wire


def send_handoff(h: KVHandoff, dst: int, device) -> None:
    """Header length, pickled header, then each payload tensor in name order."""
    head = pickle.dumps(h.header())
    dist.send(torch.tensor([len(head)], dtype=torch.int64, device=device), dst)
    dist.send(torch.frombuffer(bytearray(head), dtype=torch.uint8).to(device), dst)
    for name in sorted(h.payload):
        dist.send(h.payload[name].contiguous(), dst)


def recv_handoff(src: int, device) -> KVHandoff | None:
    """The next handoff from `src`, or None when it says it closes (a negative length)."""
    n = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(n, src)
    if n.item() < 0:
        return None
    buf = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    dist.recv(buf, src)
    head = pickle.loads(buf.cpu().numpy().tobytes())
    payload = {}
    for name, shape, dtype in head["tensors"]:
        payload[name] = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(payload[name], src)
    return KVHandoff.from_header(head, payload)


# --------------------------------------------------------------------------------------------------- the workers


def _load(spec, dtype: str, device):
    from .parallel import load_for_rank

    if isinstance(spec, dict):
        return load_for_rank(spec, dtype, device), None
    from .loader import load_model

    return load_model(spec, dtype=dtype, device=str(device))


def _worker_main(rank: int, spec, dtype: str, threads: int, engine_kwargs: dict, port: int, device: str,
                 inbox, events, fault: str | None) -> None:
    torch.set_num_threads(threads)
    role = "prefill" if rank == PREFILL else "decode"
    try:
        from .distributed import init_group, weights_checksum
        from .engine import LLM

        dev = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if device == "cuda" else "cpu")
        model, tok = _load(spec, dtype, dev)
        llm = LLM.from_model(model, tok, **engine_kwargs)
        pool = llm.cache.spec
        events.put(("ready", role, {"checksum": weights_checksum(model), "block_size": pool.block_size,
                                    "kv_dtype": str(pool.storage_dtype), "layers": pool.n_layers,
                                    "kv_heads": pool.n_kv_heads, "head_dim": pool.head_dim,
                                    "num_blocks": pool.num_blocks, "vocab_size": model.config.vocab_size}))
        init_group(rank, 2, port, "nccl" if device == "cuda" else "gloo", _GROUP_TIMEOUT_S)
        try:
            (_prefill_loop if rank == PREFILL else _decode_loop)(llm, dev, inbox, events, fault)
        finally:
            dist.destroy_process_group()
    except BaseException:
        events.put(("fatal", role, traceback.format_exc()))
        raise


def _next_message(inbox, busy: bool):
    try:
        return inbox.get_nowait() if busy else inbox.get(timeout=0.02)
    except queue.Empty:
        return None


def _prefill_loop(llm, device, inbox, events, fault) -> None:
    decode_alive, n_sent = True, 0
    while True:
        msg = _next_message(inbox, llm.has_unfinished())
        while msg is not None:
            if msg[0] == "stop":
                if decode_alive:  # tell the receiver thread to stop
                    try:
                        dist.send(torch.tensor([-1], dtype=torch.int64, device=device), DECODE)
                    except Exception:
                        pass
                return
            _, rid, prompt, params = msg
            try:
                llm.add_prefill(prompt, params, request_id=rid)
            except (ValueError, TypeError) as e:
                events.put(("error", rid, f"refused: {e}"))
            msg = _next_message(inbox, True)
        if llm.has_unfinished():
            llm.step()
        for h in llm.pop_handoffs():
            events.put(("prefilled", h.request_id, {"prompt_ids": h.prompt_ids, "nbytes": h.nbytes,
                                                    "t": time.perf_counter()}))
            if h.finish_reason is not None:  # the first token ended it: nothing to move
                tok = llm.tokenizer
                text = tok.decode([t for t in h.output_ids if t not in h.stop_ids]) if tok is not None else ""
                events.put(("token", h.request_id, h.output_ids[0], text, True, h.finish_reason))
                continue
            if not decode_alive:
                events.put(("error", h.request_id, "the decode worker is gone: cannot hand the KV over"))
                continue
            injected = fault[0] if fault is not None and fault[1] == n_sent else None  # tests only
            n_sent += 1
            if injected == "corrupt":
                next(iter(h.payload.values())).view(-1)[0] += 1
            try:
                t0 = time.perf_counter()
                if injected == "die_mid_transfer":
                    dist.send(torch.tensor([10**6], dtype=torch.int64, device=device), DECODE)
                    os._exit(3)
                send_handoff(h, DECODE, device)
                events.put(("sent", h.request_id, {"t_send": t0}))
            except Exception as e:  # the peer died: report, keep prefilling what can end here
                decode_alive = False
                events.put(("error", h.request_id, f"KV transfer to the decode worker failed: {e}"))


def _decode_loop(llm, device, inbox, events, fault) -> None:
    if fault is not None and fault[0] == "unpack":  # write part of the KV, then fail: the engine must give the blocks back
        from . import kv_transfer

        real_unpack = kv_transfer.unpack_kv_blocks

        def broken_unpack(pool, block_table, payload):
            real_unpack(pool, block_table[:1], {n: t[:, :1] for n, t in payload.items()})
            raise RuntimeError("injected fault while writing the KV blocks")
        kv_transfer.unpack_kv_blocks = broken_unpack
    arrived: queue.Queue = queue.Queue()

    def receive() -> None:  # the only thread that touches the process group here
        try:
            while (h := recv_handoff(PREFILL, device)) is not None:
                arrived.put((h, time.perf_counter()))
        except Exception as e:
            arrived.put(e)

    threading.Thread(target=receive, daemon=True, name="kv-receiver").start()
    sink: queue.SimpleQueue = queue.SimpleQueue()
    pending: deque = deque()  # handoffs with no room yet: kept in order, never dropped
    while True:
        msg = _next_message(inbox, True)
        if msg is not None and msg[0] == "stop":
            return
        if msg is not None and msg[0] == "abort":
            llm.abort(msg[1])
        busy = llm.has_unfinished() or bool(pending)
        try:
            item = arrived.get_nowait() if busy else arrived.get(timeout=0.02)
            while True:
                if isinstance(item, Exception):
                    events.put(("link_lost", "decode", f"{item}"))
                else:
                    pending.append(item)
                item = arrived.get_nowait()
        except queue.Empty:
            pass
        while pending:
            h, t_recv = pending[0]
            if not llm.can_add_prefilled(h) and llm.has_unfinished():
                break  # blocks come back as decodes finish
            pending.popleft()
            try:
                llm.add_prefilled(h, sink)
                events.put(("received", h.request_id, {"t_recv": t_recv, "t_added": time.perf_counter()}))
            except Exception as e:
                events.put(("error", h.request_id, f"the decode worker refused the KV: {e}",
                            {"free_blocks": llm.num_free_blocks()}))
        if llm.has_unfinished():
            llm.step()
        while not sink.empty():
            ev = sink.get()
            events.put(("token", ev.request_id, ev.token_id, ev.text, ev.finished, ev.finish_reason))
            if ev.finished:
                llm.pop_output(ev.request_id)
                events.put(("free_blocks", llm.num_free_blocks()))


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

        from .distributed import free_port, without_main_reimport

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
        if isinstance(prompts, (str, bytes)) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("pass a list of prompts (strings or lists of token ids), e.g. [prompt]")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
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
        """Feed minillm.workload Requests at their arrival times (like workload.serve); (outputs, wall seconds)."""
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
