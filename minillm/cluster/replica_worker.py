"""Inside one replica process of a ReplicaPool (lesson 13): load the model, build the engine, serve commands.

replicas.py runs `_replica_main` in each worker of a cluster/workers.py WorkerPool. It loads the model (a name
or a minillm.gguf.loader.load_spec spec), reports its weights' checksum, builds LLM.from_model(...,
enable_prefix_caching=True) and runs server.py's EngineThread, which steps the engine while requests are
unfinished. Commands come in (add, abort, reset, stop); events go out, one per token (a request's last carries
the replica's prefix-cache stats). `Fault` makes a replica slow or crash, for tests and drills.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fault:
    """For tests and failure drills: make a replica slow (sleep before each step) or crash (exit after n
    steps)."""

    step_delay_s: float = 0.0
    exit_after_steps: int | None = None


# -------------------------------------------------------------------------------- inside a replica process

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


def _replica_main(link, replica_id: int, spec, dtype: str, engine_kwargs: dict, threads: int,
                  fault: Fault | None) -> None:
    from minillm.gguf.loader import load_spec
    from minillm.parallel.distributed import weights_checksum
    from minillm.serving.engine_thread import EngineThread

    torch.set_num_threads(threads)
    model, tok = load_spec(spec, dtype)  # a failure here is the worker's "fatal": the pool raises it
    llm = _build_engine(model, tok, engine_kwargs, fault)
    bm = llm.block_manager
    link.send("ready", {"checksum": weights_checksum(model), "num_blocks": bm.num_blocks,
                        "block_size": bm.block_size, "vocab_size": model.config.vocab_size,
                        "max_seq_len": model.config.max_seq_len})
    engine = EngineThread(llm, max_waiting=1 << 30)  # the pool keeps the queue; the engine takes everything

    def reset() -> None:  # a fresh engine, same weights: empty KV cache, zeroed stats (runs between steps)
        engine.llm = _build_engine(model, tok, engine_kwargs, fault)

    def report(kind: str, rid: str | None):
        def done(fut) -> None:
            if fut.exception() is not None:
                link.send("rejected" if kind == "add" else "failed", rid, str(fut.exception()))
            elif kind == "reset":
                link.send("reset_done")
        return done

    engine.start()
    try:
        while True:
            if engine.error is not None:
                link.send("failed", None, f"engine step failed: {engine.error!r}")
                return
            msg = link.recv(timeout=0.2)  # ("stop",) too when the pool is gone: no orphan lingers
            if msg is None:
                continue
            kind, *args = msg
            if kind == "stop":
                return
            if kind == "add":
                rid, ids, params = args
                engine.post(engine.add, ids, params, rid, _ForwardSink(link.send, engine)).add_done_callback(
                    report("add", rid))
            elif kind == "abort":
                engine.post(lambda r: engine.llm.abort(r), args[0])
            elif kind == "reset":
                engine.post(reset).add_done_callback(report("reset", None))
    finally:
        engine.stop(5.0)
