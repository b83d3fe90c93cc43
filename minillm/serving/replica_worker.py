"""Inside one replica process of a ReplicaPool (lesson 13): load the model, build the engine, serve the pipes.

minillm/serving/replicas.py starts one process per replica with `_replica_main`. It loads the model (a name or a
minillm.gguf.loader.load_spec spec), reports its weights' checksum, builds LLM.from_model(...,
enable_prefix_caching=True) and runs server.py's EngineThread, which steps the engine while requests are unfinished.
Commands come in on one pipe (add, abort, reset, stop); events go out on another, one per token (the last one of a
request carries the replica's prefix-cache stats). `Fault` makes a replica slow or crash, for tests and drills.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import traceback
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fault:
    """For tests and failure drills: make a replica slow (sleep before each step) or crash (exit after n steps)."""

    step_delay_s: float = 0.0
    exit_after_steps: int | None = None


# ------------------------------------------------------------------------------------- inside a replica process

def _build_engine(model, tokenizer, engine_kwargs: dict, fault: Fault | None):
    from minillm.engine import LLM

    llm = LLM.from_model(model, tokenizer, enable_prefix_caching=True, **engine_kwargs)
    if fault is not None:
        step, steps = llm.step, itertools.count(1)

        def faulty_step():
            if fault.exit_after_steps is not None and next(steps) > fault.exit_after_steps:
                os._exit(3)  # a crash: no goodbye, no cleanup
            time.sleep(fault.step_delay_s)
            return step()

        llm.step = faulty_step
    return llm


class _ForwardSink:
    """Where the engine puts one request's StreamEvents (engine thread): sent to the pool at once."""

    def __init__(self, send, engine):
        self.send, self.engine = send, engine

    def put(self, ev) -> None:
        stats = None
        if ev.finished:  # the engine thread pops its output (else it would pile up in the engine)
            self.engine.retired.append(ev.request_id)
            self.engine.wake.set()
            stats = self.engine.llm.prefix_cache_stats.as_dict()
        self.send("event", ev.request_id, ev.token_id, ev.text, ev.finished, ev.finish_reason, stats)


def _replica_main(replica_id: int, spec, dtype: str, engine_kwargs: dict, threads: int, fault: Fault | None,
                  parent_pid: int, inbox, outbox) -> None:
    from minillm.parallel.distributed import weights_checksum
    from minillm.serving.server import EngineThread

    torch.set_num_threads(threads)
    lock = threading.Lock()  # two threads send: this one and the engine thread

    def send(*msg) -> None:
        with lock:
            try:
                outbox.send(msg)
            except OSError:  # the pool is gone: nobody to tell
                pass

    try:
        from minillm.gguf.loader import load_spec

        model, tok = load_spec(spec, dtype)
        llm = _build_engine(model, tok, engine_kwargs, fault)
        bm = llm.block_manager
        send("ready", weights_checksum(model), bm.num_blocks, bm.block_size, model.config.vocab_size,
             model.config.max_seq_len)
    except BaseException:  # noqa: BLE001  (the pool reports it)
        send("error", traceback.format_exc())
        return
    engine = EngineThread(llm, max_waiting=1 << 30)  # the pool keeps the queue; the engine takes everything

    def reset() -> None:  # a fresh engine over the same weights: empty KV cache, zeroed stats (runs between steps)
        engine.llm = _build_engine(model, tok, engine_kwargs, fault)

    def report(kind: str, rid: str | None):
        def done(fut) -> None:
            if fut.exception() is not None:
                send("rejected" if kind == "add" else "failed", rid, str(fut.exception()))
            elif kind == "reset":
                send("reset_done")
        return done

    engine.start()
    try:
        while True:
            if engine.error is not None:
                send("failed", None, f"engine step failed: {engine.error!r}")
                return
            if not inbox.poll(0.2):
                if os.getppid() != parent_pid:  # the pool died without closing us: don't linger as an orphan
                    return
                continue
            try:
                kind, *args = inbox.recv()
            except EOFError:
                return
            if kind == "stop":
                return
            if kind == "add":
                rid, ids, params = args
                engine.post(engine.add, ids, params, rid, _ForwardSink(send, engine)).add_done_callback(
                    report("add", rid))
            elif kind == "abort":
                engine.post(lambda r: engine.llm.abort(r), args[0])
            elif kind == "reset":
                engine.post(reset).add_done_callback(report("reset", None))
    finally:
        engine.stop(5.0)
