"""One worker-process lifecycle (lesson 13): `WorkerPool` and `PoolFrontEnd`, under DisaggregatedLLM and ReplicaPool.

Serving from several processes costs a lifecycle per front end: spawn, wait until ready, notice deaths, shut down
without orphans. It is written once here; the front ends keep only their own protocol. Inside a worker,
`WorkerLink` is its end of the pipes.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait

from minillm.parallel.distributed import stop_processes, without_main_reimport


class WorkerError(RuntimeError):
    """A worker failed, exited, or answered something else than what its pool waited for."""


class WorkerTimeout(WorkerError, TimeoutError):
    """A worker did not answer in time."""


# ------------------------------------------------------------------------------------------ inside a worker


class WorkerLink:
    """A worker's end of its two pipes: `send` events (from any thread), `recv` the next command. A reader
    thread drains the command pipe, so the pool's sends never wait for a busy worker, and the pool gone (the
    pipe closed) arrives as ("stop",): no orphan keeps running."""

    def __init__(self, commands, events):
        self._events, self._lock, self._inbox = events, threading.Lock(), queue.SimpleQueue()
        threading.Thread(target=self._read, args=(commands,), daemon=True, name="worker-commands").start()

    def _read(self, commands) -> None:
        try:
            while True:
                self._inbox.put(commands.recv())
        except (EOFError, OSError):
            self._inbox.put(("stop",))

    def recv(self, timeout: float = 0.0) -> tuple | None:
        """The next command, waiting up to `timeout` seconds; None if none came."""
        try:
            return self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return None

    def send(self, *msg) -> bool:
        """Send one event to the pool; False if the pool is gone (nobody to tell)."""
        with self._lock:
            try:
                self._events.send(msg)
                return True
            except OSError:
                return False


def _worker_entry(target: Callable, commands, events, args: tuple) -> None:
    """A worker process: target(link, *args). An exception is sent to the pool as ("fatal", traceback) and the
    process exits with code 1 (quietly: the pool raises it)."""
    link = WorkerLink(commands, events)
    try:
        target(link, *args)
    except BaseException:  # noqa: BLE001  (reported to the pool, which raises it)
        tb = traceback.format_exc()
        if not link.send("fatal", tb):
            print(tb, file=sys.stderr)
        sys.exit(1)


# -------------------------------------------------------------------------------------------- the pool's side


class WorkerPool:
    """Spawned worker processes, one per `args` tuple, each running target(link, *args); `labels` name them in
    errors ("the decode worker", "replica 0"). Messages are tuples whose first item says what they are.

      start     spawned (the caller's script not run again), a command pipe in and an event pipe out each;
      ready     `expect("ready", timeout)`: each one's ("ready", info); failing or exiting first is an error;
      liveness  `poll` hands over what they sent, `dead` names those that exited: their requests are the
                caller's to fail (DisaggregatedLLM) or retry elsewhere (ReplicaPool);
      close     ask each to stop, join, then terminate, then kill: no worker outlives its pool."""

    def __init__(self, target: Callable, args: list[tuple], labels: list[str]):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.labels = list(labels)
        self.processes: list = []
        self._commands: list = []
        self._events: list = []
        self._open: list[bool] = []  # the event pipe has not hit EOF
        self._closed = False
        try:
            for label, a in zip(self.labels, args, strict=True):
                cmd_r, cmd_w = ctx.Pipe(duplex=False)
                ev_r, ev_w = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_worker_entry, args=(target, cmd_r, ev_w, a), daemon=True,
                                   name="minillm-" + label.removeprefix("the ").replace(" ", "-"))
                with without_main_reimport():
                    proc.start()
                cmd_r.close(), ev_w.close()  # the child's ends: closing ours makes a dead child read as EOF
                self.processes.append(proc), self._commands.append(cmd_w), self._events.append(ev_r)
                self._open.append(True)
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return len(self.processes)

    def send(self, i: int, *msg) -> bool:
        """Send worker i one command; False if its pipe is closed (the worker is gone)."""
        try:
            self._commands[i].send(msg)
            return True
        except (OSError, ValueError):
            return False

    def dead(self, among=None) -> list[int]:
        """The workers (of `among`, default all) whose process has exited."""
        return [i for i in (range(len(self)) if among is None else among) if not self.processes[i].is_alive()]

    def exitcode(self, i: int) -> int | None:
        return self.processes[i].exitcode

    def _next(self, i: int) -> tuple | None:
        """Worker i's next message if one has arrived (None if not, or if its pipe has closed)."""
        if self._open[i]:
            try:
                if self._events[i].poll():
                    return self._events[i].recv()
            except (EOFError, OSError):
                self._open[i] = False
        return None

    def _wait(self, ids, timeout: float) -> None:
        """Until a message arrives from, or an exit of, one of the workers `ids` (at most `timeout` s)."""
        waitables = [self._events[i] for i in ids if self._open[i]]
        waitables += [self.processes[i].sentinel for i in ids if self.processes[i].exitcode is None]
        wait(waitables, timeout)  # nothing left to wait on: sleeps

    def poll(self, timeout: float, among=None) -> list[tuple[int, tuple]]:
        """(worker, message) for all the workers (of `among`, default all) sent, waiting up to `timeout` s
        for the first message or exit. A worker that died shows in `dead`; its requests are the caller's."""
        ids = list(range(len(self)) if among is None else among)
        self._wait(ids, timeout)
        out = []
        for i in ids:
            while (msg := self._next(i)) is not None:
                out.append((i, msg))
        return out

    def expect(self, kind: str, timeout_s: float, among=None, skip: tuple[str, ...] = ()) -> list[tuple]:
        """Wait for each worker (of `among`, default all) to send (kind, *args); their args, in order.
        Messages of the kinds in `skip` are dropped; any other, an exit, or no answer in timeout_s is a
        WorkerError."""
        ids = list(range(len(self)) if among is None else among)
        what = "start" if kind == "ready" else f"answer {kind!r}"
        got: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(ids):
            waiting = [i for i in ids if i not in got]
            self._wait(waiting, min(0.1, max(0.0, deadline - time.monotonic())))
            for i in waiting:
                while i not in got and (msg := self._next(i)) is not None:
                    if msg[0] == kind:
                        got[i] = tuple(msg[1:])
                    elif msg[0] not in skip:
                        raise WorkerError(f"{self.labels[i]} failed to {what}:\n{msg[-1]}")
                if i not in got and not self._open[i]:
                    self.processes[i].join(5)
                    code = self.exitcode(i)
                    raise WorkerError(f"{self.labels[i]} exited (code {code}) before it could {what}")
            if len(got) < len(ids) and time.monotonic() > deadline:
                late = " and ".join(self.labels[i] for i in ids if i not in got)
                raise WorkerTimeout(f"{late} did not {what} within {timeout_s:.0f} s")
        return [got[i] for i in ids]

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask every worker to stop, wait up to timeout_s, then terminate, then kill; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for i, proc in enumerate(self.processes):
            if proc.is_alive():
                self.send(i, "stop")
        stop_processes(self.processes, timeout_s)
        for conn in self._commands + self._events:
            conn.close()


class PoolFrontEnd:
    """The lifecycle every front end over a WorkerPool shares: start the workers and wait until each is ready on
    the same weights, refuse calls once closed, close (by `with`, by hand, or when collected)."""

    _workers: WorkerPool | None = None
    _closed = True  # until _start_workers: an __init__ that failed before it has nothing to close

    def _start_workers(self, target: Callable, args: list[tuple], labels: list[str], timeout_s: float,
                       what: str, check: Callable[[list[dict]], None] | None = None) -> list[dict]:
        """Spawn the workers and return each one's ready info (a dict with its "checksum"), after refusing
        different weights (`what` names the workers) and whatever `check` refuses. A failure closes every worker
        before it propagates: a front end that failed to start leaves no process behind."""
        self._closed = False
        self._workers = WorkerPool(target, args, labels)
        try:
            ready = [info for (info,) in self._workers.expect("ready", timeout_s)]
            require_same_weights(what, [r["checksum"] for r in ready])
            if check is not None:
                check(ready)
        except BaseException:
            self.close()
            raise
        return ready

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} is closed: make a new one")

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every worker (politely, then terminate/kill) and wait for it; safe to call twice (the pool's close
        is)."""
        self._closed = True
        if self._workers is not None:
            self._workers.close(timeout_s)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:  # at interpreter exit too: a short grace, then terminate, never an error from a finalizer
            self.close(timeout_s=1.0)
        except Exception:
            pass


def require_same_weights(what: str, checksums: list[float]) -> None:
    """Refuse workers that loaded different weights (distributed.weights_checksum of each): another file or
    dtype would give silently different answers from one request to the next."""
    if any(s != checksums[0] for s in checksums):
        raise RuntimeError(f"{what} loaded different weights (checksums {checksums}): every worker must load "
                           f"the same model file with the same dtype")


def raise_if_failed(outputs: list) -> None:
    """RuntimeError naming every request that ended with finish_reason "error" (metrics["error"] says why),
    grouped by why: what a front end over workers raises unless the caller asked for the outputs as they are."""
    by_why: dict[str, list[str]] = {}
    for o in outputs:
        if o.finish_reason == "error":
            by_why.setdefault(o.metrics.get("error") or "unknown error", []).append(o.request_id)
    if by_why:
        n = sum(map(len, by_why.values()))
        raise RuntimeError(f"{n} of {len(outputs)} requests failed; " + "; ".join(
            f"request{'s' * (len(ids) > 1)} {', '.join(ids)}: {why}" for why, ids in by_why.items()))


__all__ = ["PoolFrontEnd", "WorkerError", "WorkerLink", "WorkerPool", "WorkerTimeout", "raise_if_failed",
           "require_same_weights"]
