"""Running one model on several processes: start the ranks, fail fast, count the bytes exchanged (lesson 11).

Real torch.distributed process groups (gloo on CPU, NCCL on GPU), one process per rank, started by `launch` or
by `torchrun` (whose RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT `init_group` reads). `launch` returns rank
0's result, or stops every rank and raises naming the one that failed; every group has a timeout. `Comm`: the
collectives the parallel model calls, each counted (calls, bytes, the bytes a ring moves per rank, time
inside). `check_same_weights` compares a weight checksum across ranks before the first collective. The
parallel transformations are tensor_parallel.py, sequence_parallel.py and pipeline_parallel.py.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor

DEFAULT_TIMEOUT_S = 60.0


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it): parallel test runs never clash on a fixed port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def without_main_reimport():
    """Start spawned processes without running the caller's script again in each of them.

    A spawned child re-imports the script that started it (as __mp_main__), so that functions defined there can be
    unpickled. A lesson run as a script (`python lessons/13_disaggregation.py`) has no `if __name__ == "__main__"`
    guard: every worker would run it from the top and try to start workers of its own. minillm's workers only run
    functions of minillm, so the script is not needed: its path is hidden while the processes start."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or getattr(main, "__spec__", None) is not None:  # a notebook / REPL, or `python -m`
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def stop_processes(processes, timeout_s: float = 10.0) -> None:
    """Wait up to timeout_s (all together) for the processes to exit, then terminate, then kill what is left:
    none outlives the call. One shutdown sequence for launch's ranks and cluster/workers.py's workers."""
    deadline = time.monotonic() + timeout_s
    for p in processes:
        if p.pid is not None:
            p.join(max(0.0, deadline - time.monotonic()))
    for stop in ("terminate", "kill"):
        for p in processes:
            if p.pid is not None and p.is_alive():
                getattr(p, stop)()
                p.join(2.0)


def init_group(rank: int | None = None, world_size: int | None = None, port: int | None = None,
               backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Join the default process group (arguments default to torchrun's environment). Returns (rank, world_size)."""
    rank = int(os.environ["RANK"]) if rank is None else rank
    world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ["MASTER_PORT"]) if port is None else port
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world_size


def _rank_main(rank: int, fn: Callable, world_size: int, port: int, backend: str | None, timeout_s: float,
               threads: int | None, results, args: tuple) -> None:
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // world_size))
    init_group(rank, world_size, port, backend, timeout_s)
    if dist.get_backend() == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    try:
        # plain pickle bytes: torch's queue pickler would share tensors through file descriptors of a process that
        # has exited by the time the parent reads them
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        # reported before this rank's connections close: the peers then fail with "connection reset", later
        results.put((rank, "error", pickle.dumps((time.time(), traceback.format_exc()))))
        raise
    finally:
        dist.destroy_process_group()


def rank_device() -> torch.device:
    """The device this rank computes on: its own GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def launch(fn: Callable, world_size: int, *args, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
           threads: int | None = None):
    """Run fn(rank, world_size, *args) on `world_size` new processes in one process group; return every rank's
    result, in rank order.

    fn must be importable (a module-level function: the ranks are fresh interpreters). Each rank uses `threads`
    torch threads (default: the cores split evenly). If a rank raises or is killed, the others are stopped and a
    RuntimeError names it; a collective waiting on a dead peer gives up after timeout_s."""
    import torch.multiprocessing as mp

    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    results = mp.get_context("spawn").SimpleQueue()
    out: dict[int, object] = {}
    errors: dict[int, tuple[float, str]] = {}

    def drain() -> None:  # read while the ranks run: a result larger than the pipe's buffer blocks its sender
        while not results.empty():
            rank, kind, value = results.get()
            (out if kind == "ok" else errors)[rank] = pickle.loads(value)

    with without_main_reimport():
        context = mp.start_processes(_rank_main, args=(fn, world_size, free_port(), backend, timeout_s, threads,
                                                       results, args), nprocs=world_size, join=False,
                                     start_method="spawn")
    try:
        while not context.join(timeout=0.05):
            drain()
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:  # join has stopped the other ranks
        drain()
        rank, why = _first_failure(e, errors, context.processes)
        raise RuntimeError(f"rank {rank} of {world_size} failed, the others were stopped:\n{why}") from None
    finally:  # interrupted (Ctrl-C, an unreadable result): no rank is left running
        stop_processes(context.processes, timeout_s=0.0)
    drain()
    missing = [r for r in range(world_size) if r not in out]
    if missing:
        raise RuntimeError(f"rank {', '.join(map(str, missing))} of {world_size} exited without returning a result "
                           f"(it left without an error: exit(0) inside it, or its result could not be pickled)")
    return [out[r] for r in range(world_size)]


# what a rank reports when a peer died under it: a consequence, not the cause
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket closed")


def _first_failure(exc, errors: dict[int, tuple[float, str]], processes) -> tuple[int, str]:
    """Which rank caused the failure: the earliest error that is not a lost connection; else a rank that died
    without a word (killed: not the SIGTERM join sends the survivors); else the earliest error of any kind."""
    causes = {r: v for r, v in errors.items() if not any(s in v[1] for s in _PEER_GONE)}
    if causes:
        rank, (_, tb) = min(causes.items(), key=lambda kv: kv[1][0])
        return rank, tb
    silent = [r for r, p in enumerate(processes) if r not in errors and p.exitcode not in (None, 0, -signal.SIGTERM)]
    if silent:
        code = processes[silent[0]].exitcode
        how = f"it was killed by {signal.Signals(-code).name}" if code < 0 else f"it exited with code {code}"
        return silent[0], how
    if errors:
        rank, (_, tb) = min(errors.items(), key=lambda kv: kv[1][0])
        return rank, tb
    return exc.error_index, str(exc)


class Comm:
    """The collectives of one process group, counted. `stats` maps an op name to calls / bytes / ring bytes."""

    def __init__(self, group=None):
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()  # bytes of the tensors handed to each op (the full tensor for a gather)
        self.ring_bytes: Counter = Counter()  # bytes a ring algorithm sends per rank for them
        self.seconds = 0.0

    def _count(self, op: str, nbytes: int, ring_factor: float, start: float) -> None:
        self.calls[op] += 1
        self.bytes[op] += nbytes
        self.ring_bytes[op] += ring_factor * nbytes
        self.seconds += time.perf_counter() - start

    def reset(self) -> None:
        self.calls.clear(), self.bytes.clear(), self.ring_bytes.clear()
        self.seconds = 0.0

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum x over the ranks, in place; every rank gets the sum."""
        t0, p = time.perf_counter(), self.world_size
        if p > 1:
            dist.all_reduce(x, group=self.group)
        self._count("all_reduce", x.numel() * x.element_size(), 2 * (p - 1) / p, t0)
        return x

    def all_gather(self, x: Tensor, dim: int) -> Tensor:
        """Concatenate every rank's x along dim (rank order)."""
        t0, p = time.perf_counter(), self.world_size
        if p == 1:
            out = x
        else:
            parts = [torch.empty_like(x) for _ in range(p)]
            dist.all_gather(parts, x.contiguous(), group=self.group)
            out = torch.cat(parts, dim=dim)
        self._count("all_gather", out.numel() * out.element_size(), (p - 1) / p, t0)
        return out

    def reduce_scatter(self, x: Tensor, dim: int) -> Tensor:
        """Sum x over the ranks and keep this rank's 1/p slice along dim (x.shape[dim] divisible by p)."""
        t0, p = time.perf_counter(), self.world_size
        if p == 1:
            out = x
        else:
            moved = x.movedim(dim, 0).contiguous()
            out = torch.empty((moved.shape[0] // p, *moved.shape[1:]), dtype=x.dtype, device=x.device)
            dist.reduce_scatter_single(out, moved, group=self.group)
            out = out.movedim(0, dim)
        self._count("reduce_scatter", x.numel() * x.element_size(), (p - 1) / p, t0)
        return out

    def send(self, x: Tensor, dst: int) -> None:
        t0 = time.perf_counter()
        dist.send(x.contiguous(), dst, group=self.group)
        self._count("send", x.numel() * x.element_size(), 1.0, t0)

    def recv(self, shape: tuple, dtype: torch.dtype, src: int, device="cpu") -> Tensor:
        t0 = time.perf_counter()
        x = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(x, src, group=self.group)
        self._count("recv", x.numel() * x.element_size(), 1.0, t0)
        return x

    def broadcast(self, x: Tensor, src: int) -> Tensor:
        t0 = time.perf_counter()
        if self.world_size > 1:
            dist.broadcast(x, src, group=self.group)
        self._count("broadcast", x.numel() * x.element_size(), 1.0, t0)
        return x

    def stats(self) -> dict[str, dict[str, float]]:
        return {op: {"calls": self.calls[op], "bytes": self.bytes[op], "ring_bytes": self.ring_bytes[op]}
                for op in self.calls}


def weights_checksum(model) -> float:
    """One number that changes if any weight differs (float64 sum of every parameter, scaled by its position)."""
    total = 0.0
    for i, p in enumerate(model.parameters()):
        total += (i + 1) * float(p.detach().double().sum())
    return total


def check_same_weights(model, comm: Comm) -> None:
    """Refuse to run when the ranks hold different weights (another file, another dtype): compared before the first
    model collective, so a mismatch is an error, not silently wrong logits."""
    mine = torch.tensor([weights_checksum(model)], dtype=torch.float64, device=model.device)
    sums = comm.all_gather(mine, 0).tolist() if comm.world_size > 1 else [mine.item()]
    if any(s != sums[0] for s in sums):
        raise RuntimeError(f"ranks loaded different weights (checksums {sums}): every rank must load the same model "
                           f"file with the same dtype")
    comm.reset()


__all__ = ["DEFAULT_TIMEOUT_S", "Comm", "check_same_weights", "free_port", "init_group", "launch",
           "rank_device", "stop_processes", "weights_checksum", "without_main_reimport"]
