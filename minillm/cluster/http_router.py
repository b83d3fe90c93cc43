"""`minillm serve` x N behind sglang-router (lesson 13): ReplicaPool's routing question, asked over HTTP.

Past one machine each engine is its own server, and the router in front is one users already run: sglang-router
(PyPI, Rust) keeps a radix tree of the text it sent each worker (policy cache_aware), retries a failed request and
takes a worker whose health checks fail out of rotation. This module starts N servers and that router on loopback
(tests, lesson 13) and measures one shared-prefix workload under two of its policies: the servers' prefix-cache hit
rate (their /metrics) and the time to first token at the client.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from minillm.measure.metrics import percentiles

# the routers this was tried with (the module `python -m` runs); vllm-router is a fork of sglang-router, same flags
ROUTERS = {"sglang": "sglang_router.launch_router", "vllm": "vllm_router.launch_router"}
# a killed server must leave the rotation in about a second, not the defaults' minutes: a health check every
# second, one failure marks a worker unhealthy, and 3 failed requests open its circuit (defaults 60 s, 3, 10)
ROUTER_OPTIONS = ("--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                  "--health-check-timeout-secs", "2", "--cb-failure-threshold", "3")
ROOT = str(Path(__file__).resolve().parents[2])  # the checkout: children import it whether or not it is installed


def free_port() -> int:
    """A port nobody listens on now (the OS picks it); a child binds it a moment later."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A child process whose output a thread keeps reading (a full pipe would block it); the last lines are kept
    for the error message when it does not start."""

    def __init__(self, name: str, cmd: list[str]):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
        self.name, self.lines = name, deque(maxlen=200)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def wait_for(self, ready, timeout: float, what: str):
        """Poll ready() (a value, or None while not yet) until it gives one; raise with the output if the process
        exits or `timeout` seconds pass first."""
        deadline = time.monotonic() + timeout
        while (value := ready()) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                state = f"exited with {self.proc.returncode}" if self.proc.poll() is not None else "timed out"
                raise RuntimeError(f"{self.name}: {what} ({state}):\n" + "\n".join(list(self.lines)[-20:]))
            time.sleep(0.2)
        return value

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye; what a crashed machine looks like to the router."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGINT (a server drains its requests), then SIGKILL after `timeout` seconds."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


def start_server(options: tuple[str, ...] = (), threads: int = 1) -> Process:
    """`minillm serve` on a free port, started (server_url waits for it to be ready)."""
    return Process("minillm serve", [sys.executable, "-m", "minillm.cli", "serve", "--port", "0", "--threads",
                                     str(threads), "--log-level", "warning", "--drain-timeout", "5", *options])


def server_url(proc: Process, timeout: float = 300.0) -> str:
    """The URL its ready line announces (the port the OS gave it), once it is up."""
    def ready():
        line = next((x for x in list(proc.lines) if "ready at " in x), None)
        return line.split("ready at ")[1].split()[0].removesuffix("/v1") if line else None
    return proc.wait_for(ready, timeout, "did not start")


def start_router(worker_urls: list[str], policy: str = "cache_aware", router: str = "sglang",
                 options: tuple[str, ...] = (), timeout: float = 60.0) -> tuple[Process, str]:
    """The router on a free loopback port, its Prometheus port too (the default, 29000, would collide between two
    fleets); returns once its /workers lists every worker healthy."""
    import httpx2 as httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = Process(router + "-router", [sys.executable, "-m", ROUTERS[router], "--host", "127.0.0.1", "--port",
                                        str(port), "--worker-urls", *worker_urls, "--policy", policy,
                                        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                                        *ROUTER_OPTIONS, *options])

    def ready():
        try:
            workers = httpx.get(url + "/workers", timeout=2).json().get("workers", [])
        except (httpx.HTTPError, ValueError):
            return None
        healthy = {w["url"] for w in workers if w.get("is_healthy")}
        return url if healthy >= set(worker_urls) else None
    try:
        return proc, proc.wait_for(ready, timeout, f"did not list {len(worker_urls)} healthy workers")
    except BaseException:
        proc.stop()
        raise


@dataclass
class Fleet:
    url: str  # the router: send requests here
    servers: list[str]  # each server's own URL: its /metrics
    processes: list[Process]  # the servers'
    router: Process


@contextmanager
def http_fleet(n: int = 2, policy: str = "cache_aware", router: str = "sglang", threads: int = 1,
               server_options: tuple[str, ...] = (), router_options: tuple[str, ...] = (), timeout: float = 300.0):
    """n `minillm serve` processes (started together) and the router over them; everything stopped on exit."""
    with ExitStack() as stack:
        procs = []
        for _ in range(n):
            procs.append(start_server(server_options, threads))
            stack.callback(procs[-1].stop)
        urls = [server_url(p, timeout) for p in procs]
        rt, url = start_router(urls, policy, router, router_options)
        stack.callback(rt.stop)
        yield Fleet(url, urls, procs, rt)


def counters(url: str) -> dict[str, float]:
    """A server's /metrics samples without a label, by name without the `minillm_` prefix (requests_total,
    prefix_cache_hits_total, time_to_first_token_seconds_sum, ...)."""
    import httpx2 as httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    pairs = (line.split() for line in text.splitlines() if line.startswith("minillm_") and "{" not in line)
    return {name.removeprefix("minillm_"): float(value) for name, value in pairs}


def stream_chat(url: str, messages: list[dict], max_tokens: int = 16, timeout: float = 120.0,
                model: str = "smollm2-135m", **fields) -> dict:
    """One streamed greedy chat completion through `url`: {"text", "ttft" (s to the first content, at the client),
    "finish", "error"}. A stream that ends without [DONE] or the connection failing is an error, not a result.
    `model` is required behind sglang-router: it names a request without one "unknown"."""
    import httpx2 as httpx

    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, **fields}
    out, parts, t0 = {"text": "", "ttft": None, "finish": None, "error": None}, [], time.perf_counter()
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                out["error"] = f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}"
                return out
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    out["error"] = f"error event: {event['error'].get('message')}"
                    continue
                choice = event["choices"][0]
                if choice["delta"].get("content"):
                    out["ttft"] = out["ttft"] or time.perf_counter() - t0
                    parts.append(choice["delta"]["content"])
                out["finish"] = choice.get("finish_reason") or out["finish"]
            else:
                out["error"] = out["error"] or "the stream ended without [DONE]"
    except httpx.HTTPError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["text"] = "".join(parts)
    return out


def shared_prefix_chats(n_groups: int, per_group: int, system_chars: int, seed: int = 0
                        ) -> tuple[list[list[dict]], list[int]]:
    """n_groups x per_group chats in a seeded random order; each group has its own system prompt of about
    `system_chars` characters of CPython's docs (about 4 per token), each chat its own question."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    text = "\n\n".join(topics[k] for k in names)
    order = [g for g in range(n_groups) for _ in range(per_group)]
    random.Random(seed).shuffle(order)
    systems = [f"Reference text {g + 1}:\n\n{text[g * system_chars:(g + 1) * system_chars]}\n\nAnswer questions "
               "about Python using the reference text." for g in range(n_groups)]
    chats = [[{"role": "system", "content": systems[g]},
              {"role": "user", "content": f"What does it say about {names[(7 * k) % len(names)]}?"}]
             for k, g in enumerate(order)]
    return chats, order


def _run(url: str, chats: list[list[dict]], arrivals: list[float], max_tokens: int, timeout: float) -> list[dict]:
    """Each chat streamed from its own thread at its arrival time (seconds from now)."""
    results, t0 = [None] * len(chats), time.perf_counter()

    def one(k: int) -> None:
        time.sleep(max(0.0, t0 + arrivals[k] - time.perf_counter()))
        results[k] = stream_chat(url, chats[k], max_tokens, timeout)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(chats))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def measure(policies: tuple[str, ...] = ("round_robin", "cache_aware"), n_servers: int = 2, n_groups: int = 4,
            per_group: int = 6, system_chars: int = 1300, max_tokens: int = 16, rate: float = 0.4,
            threads: int = 1, router: str = "sglang", router_options: tuple[str, ...] = (), seed: int = 0,
            timeout: float = 300.0) -> dict:
    """The same chats (Poisson arrivals at `rate` req/s) through a fresh fleet per policy (empty caches, same
    start): per policy the prefix-cache hit rate over the servers, client TTFT p50/p99/mean, the servers' own mean
    TTFT, requests per server, and whether the greedy texts equal the first policy's.

    What cache_aware does with a chat whose text matches no worker's tree by more than --cache-threshold (0.3): it
    sends it to the worker with the fewest requests in flight, so on an idle fleet new groups pile onto one worker;
    it rebalances only past --balance-abs-threshold (64 requests) and --balance-rel-threshold (1.5x) of load gap,
    which a small fleet never reaches. Pass router_options to change them."""
    chats, groups = shared_prefix_chats(n_groups, per_group, system_chars, seed)
    rng, arrivals, t = random.Random(seed), [], 0.0
    for _ in chats:
        arrivals.append(t)
        t += rng.expovariate(rate)
    rows, texts = [], None
    for policy in policies:
        with http_fleet(n_servers, policy, router, threads, router_options=router_options,
                        timeout=timeout) as fleet:
            for u in fleet.servers:  # first-call costs (allocator, kernels) out of the measurement
                stream_chat(u, [{"role": "user", "content": "Hi"}], max_tokens=2, timeout=timeout)
            before = [counters(u) for u in fleet.servers]
            results = _run(fleet.url, chats, arrivals, max_tokens, timeout)
            after = [counters(u) for u in fleet.servers]
        failed = [r["error"] for r in results if r["error"]]
        if failed:
            raise RuntimeError(f"{policy}: {len(failed)} request(s) failed, first: {failed[0]}")
        grew = {name: [a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before)] for name in after[0]}
        ttft = [r["ttft"] for r in results]
        pct = percentiles(ttft, (50, 99))
        texts = texts or [r["text"] for r in results]
        rows.append({"policy": policy,
                     "prefix_hit_rate": sum(grew["prefix_cache_hits_total"])
                     / max(sum(grew["prefix_cache_queries_total"]), 1.0),
                     "ttft_p50_s": pct["p50"], "ttft_p99_s": pct["p99"], "ttft_mean_s": statistics.fmean(ttft),
                     "server_ttft_mean_s": sum(grew["time_to_first_token_seconds_sum"])
                     / max(sum(grew["time_to_first_token_seconds_count"]), 1.0),
                     "requests_per_server": [int(x) for x in grew["requests_total"]],
                     "same_text_as_first": sum(r["text"] == x for r, x in zip(results, texts)) / len(texts)})
    settings = {"servers": n_servers, "groups": n_groups, "per_group": per_group, "system_chars": system_chars,
                "max_tokens": max_tokens, "rate": rate, "threads": threads, "router": router,
                "router_options": list(router_options), "requests": len(chats), "group_of_request": groups}
    return {"rows": rows, "settings": settings}


__all__ = ["ROUTERS", "Fleet", "Process", "counters", "http_fleet", "measure", "shared_prefix_chats", "stream_chat"]
