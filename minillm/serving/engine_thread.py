"""The engine thread (lesson 12): one background thread owns an `LLM` and steps it while requests are unfinished;
other threads `post` commands (add, abort) that run between two steps, and each request's StreamEvents go to a sink
on the caller's asyncio loop. vLLM's shape: the HTTP server (server.py) parses and streams on its event loop, this
thread runs the model; a replica worker (replica_worker.py) runs one too.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from concurrent.futures import Future

from minillm.engine.output import StreamEvent
from minillm.sampling import SamplingParams

logger = logging.getLogger("minillm.serving.engine_thread")


class QueueFull(Exception):
    pass


class AsyncSink:
    """Where the engine puts one request's StreamEvents (on the engine thread, all n samples' for n > 1): forwarded
    to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, engine: EngineThread):
        self.loop, self.engine, self.queue = loop, engine, asyncio.Queue()

    def put(self, event) -> None:
        if event.finished:  # its output now waits in the engine: the engine thread pops it (else it would leak)
            self.engine.retired.append(event.request_id)
            self.engine.wake.set()
        try:  # call_soon_threadsafe: the one thread-safe way into a running event loop
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class EngineThread:
    """Runs llm.step() in one background thread while requests are unfinished; other threads `post` commands."""

    def __init__(self, llm, max_waiting: int, on_retire=None):
        self.llm, self.max_waiting = llm, max_waiting
        self.on_retire = on_retire  # called here with each retired request's RequestOutput (the server's metrics)
        self.wake = threading.Event()
        self.inbox: collections.deque = collections.deque()  # (function, args, Future), run between steps
        self.retired: collections.deque = collections.deque()  # ids whose last event went out
        self.in_flight: dict[str, AsyncSink] = {}  # added here, removed once retired: changed by this thread only
        self.error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="minillm-engine", daemon=True)

    # Commands (add, abort) run on the engine thread between two steps. Not add_request under the engine's
    # lock from a worker thread: the engine thread re-takes that lock between steps faster than a waiting
    # thread wakes up, so a new request could wait many steps to get in.
    def post(self, fn, *args) -> Future:
        fut: Future = Future()
        self.inbox.append((fn, args, fut))
        self.wake.set()
        return fut

    def add(self, prompt_ids: list[int], params: SamplingParams, rid: str, sink: AsyncSink,
            arrival_time: float | None = None) -> list[str]:
        """Queue params.n samples of the prompt (sample_ids(rid, n)), all into `sink`. arrival_time: when the
        request arrived (time.perf_counter()), for its time to first token; default now."""
        # backpressure: a 429 at once (a load balancer can send it elsewhere), not a queue that only grows; the n
        # samples all wait, so one request with a large n cannot fill the queue past the limit by itself
        if (waiting := len(self.llm.scheduler.waiting)) + params.n > self.max_waiting:
            raise QueueFull(f"{waiting} requests are already waiting for the engine, {self.max_waiting} may: "
                            f"retry later")
        ids = self.llm.add_samples(prompt_ids, params, request_id=rid, sink=sink, arrival_time=arrival_time)
        for r in ids:
            self.in_flight[r] = sink
        return ids

    def abort_all(self) -> int:
        return sum(self.llm.abort(rid) for rid in sorted(self.in_flight))

    def _run(self) -> None:
        while True:
            self.wake.clear()  # before looking for work: a post() after this line wakes the wait() below
            while self.inbox:
                fn, args, fut = self.inbox.popleft()
                if fut.set_running_or_notify_cancel():  # False: its caller gave up waiting (then we don't run it)
                    try:
                        fut.set_result(fn(*args))
                    except Exception as e:  # noqa: BLE001  (the caller gets it: a 400, a 429...)
                        fut.set_exception(e)
            while self.retired:
                rid = self.retired.popleft()
                self.in_flight.pop(rid, None)
                try:  # the server streamed its output already: the engine must not keep it
                    out = self.llm.pop_output(rid)
                except KeyError:
                    continue
                if self.on_retire is not None:
                    self.on_retire(out)
            if self.error is None and self.llm.has_unfinished():
                try:
                    self.llm.step()
                except Exception as e:  # a bug: end every request with an error rather than leave them hanging
                    logger.exception("engine step failed; aborting every request in flight")
                    self.error = e
                    for rid, sink in list(self.in_flight.items()):
                        try:
                            self.llm.abort(rid)
                        except Exception:  # noqa: BLE001  (the engine is broken: end the stream ourselves)
                            sink.put(StreamEvent(rid, None, "", True, "abort"))
            elif self._stopping:
                return
            else:
                self.wake.wait()

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self.wake.set()
        self._thread.join(timeout)
