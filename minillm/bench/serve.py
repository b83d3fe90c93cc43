"""Benchmark "serve" (lesson 12): the OpenAI-compatible server (serving/server.py) under load, at the client.

An asyncio load generator streams requests (SSE) at Poisson arrivals or a fixed concurrency and times every chunk:
TTFT, ITL, TPOT, E2E, throughput, goodput under `SLO`, `lost` requests; fixed output lengths (`ignore_eos`).
Workloads: short chats, chats sharing one system prompt, long documents. Given no URL it starts its own `minillm
serve` and measures the server's overhead against `LLM.generate` (`overhead`). Why rates span time: `requests_at`.

    minillm bench serve --quick          minillm bench serve --url http://127.0.0.1:8000 --rate 0.5 --rate 1
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minillm.measure.harness import BenchResult
from minillm.measure.metrics import summarize, timer
from minillm.measure.workload import corpus_ids

SLO = {"ttft_s": 2.0, "tpot_s": 0.5}
WORKLOADS = ("short-chat", "shared-system", "long-doc")
ARRIVAL_WINDOW_S = 24.0  # full mode: each rate's requests arrive over about this long (at least MIN_REQUESTS)
MIN_REQUESTS = 16


def requests_at(rate: float, window_s: float = ARRIVAL_WINDOW_S, least: int = MIN_REQUESTS) -> int:
    """How many requests a rate sends: enough to keep arriving for `window_s` seconds, and at least `least`.

    The rate sweep sends each rate's requests over the same stretch of time, not a fixed count: a queue grows at
    (offered rate - capacity) per second, so only arrivals that go on long enough past the capacity form one. A fixed
    16 requests at 4 req/s would arrive within 4 s and fit into the server's 16 slots: no queue, and goodput equal to
    throughput at every rate."""
    return max(least, round(rate * window_s))


@dataclass
class Sample:
    """One request as the client saw it (perf_counter seconds)."""

    workload: str
    t_sent: float
    t_end: float = float("nan")
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with content
    completion_tokens: int = 0
    finish_reason: str | None = None
    done: bool = False  # saw data: [DONE]
    status: int = 0
    error: str | None = None

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.done and self.finish_reason is not None and self.error is None

    @property
    def metrics(self) -> dict:
        """ttft, tpot, e2e (seconds) and itl (the gaps between content chunks), as an engine's outputs have
        them (metrics.summarize reads them)."""
        nan, c = float("nan"), self.chunk_times
        return {"ttft": c[0] - self.t_sent if c else nan, "e2e": self.t_end - self.t_sent,
                "tpot": (c[-1] - c[0]) / (self.completion_tokens - 1) if c and self.completion_tokens > 1 else nan,
                "itl": [b - a for a, b in zip(c, c[1:])]}


def make_requests(tokenizer, workload: str, n: int, out_len: int, model: str = "smollm2-135m", seed: int = 0
                  ) -> list[tuple[str, dict]]:
    """(path, JSON body) for n requests of a workload; each generates exactly out_len tokens (ignore_eos)."""
    rng, corpus = random.Random(seed), corpus_ids(tokenizer)

    def text(lo: int, hi: int) -> str:
        k = rng.randint(lo, hi)
        start = rng.randrange(len(corpus) - k)
        return tokenizer.decode(corpus[start:start + k])

    common = {"model": model, "max_tokens": out_len, "temperature": 0, "ignore_eos": True}
    system = text(480, 480)  # one long system prompt for the whole shared-system run
    out = []
    for _ in range(n):
        if workload == "short-chat":
            msgs = [{"role": "user", "content": text(16, 64) + "\n\nExplain this briefly."}]
            out.append(("/v1/chat/completions", {**common, "messages": msgs}))
        elif workload == "shared-system":
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": text(8, 32)}]
            out.append(("/v1/chat/completions", {**common, "messages": msgs}))
        elif workload == "long-doc":
            out.append(("/v1/completions", {**common, "prompt": text(768, 1024)}))
        else:
            raise ValueError(f"unknown workload {workload!r}; choose one of {WORKLOADS}")
    return out


async def send(client, url: str, path: str, body: dict, workload: str = "") -> Sample:
    """Stream one request; record when each content chunk arrived, the usage, the finish and [DONE]."""
    s = Sample(workload, time.perf_counter())
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", url + path, json=body) as r:
            s.status = r.status_code
            if r.status_code != 200:
                s.error = (await r.aread()).decode(errors="replace")[:300]
                return s
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    s.done = True
                    break
                obj = json.loads(line[len("data: "):])
                if "error" in obj:  # a stream that ends in trouble says so in an event (then [DONE])
                    s.error = f"{obj['error'].get('type')}: {obj['error'].get('message')}"
                    continue
                for choice in obj.get("choices", []):
                    if choice.get("text") or (choice.get("delta") or {}).get("content"):
                        s.chunk_times.append(time.perf_counter())
                    s.finish_reason = choice.get("finish_reason") or s.finish_reason
                if obj.get("usage"):
                    s.completion_tokens = obj["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001  (a dropped connection is a result: a lost request)
        s.error = repr(e)
    finally:
        s.t_end = time.perf_counter()
    return s


async def run_load(url: str, requests: list[tuple[str, dict]], rate: float | None = None,
                   concurrency: int | None = None, seed: int = 0, workload: str = "") -> tuple[list[Sample], float]:
    """Send `requests` with Poisson arrivals at `rate` requests/s, or `concurrency` at a time; (samples, wall s)."""
    import httpx2 as httpx

    if (rate is None) == (concurrency is None):
        raise ValueError("give a rate (Poisson arrivals) or a concurrency, not both")
    rng = random.Random(seed)
    timeout = httpx.Timeout(connect=10, read=600, write=30, pool=600)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=256)) as client:
        t0 = time.perf_counter()
        if rate is not None:
            async def later(at: float, path: str, body: dict) -> Sample:
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                return await send(client, url, path, body, workload)

            at, tasks = 0.0, []
            for path, body in requests:
                tasks.append(later(at, path, body))
                at += rng.expovariate(rate)
            samples = list(await asyncio.gather(*tasks))
        else:
            todo, samples = list(requests), []

            async def worker() -> None:
                while todo:
                    path, body = todo.pop(0)
                    samples.append(await send(client, url, path, body, workload))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        return samples, time.perf_counter() - t0


def summarize_load(samples: list[Sample], wall_s: float, slo: dict = SLO) -> dict:
    """What did not complete (lost, 4xx, 5xx), then metrics.summarize of the completed requests: throughput,
    latency percentiles (seconds), goodput under the SLO (slo_attained over every request sent)."""
    done = [s for s in samples if s.completed]
    out = {"sent": len(samples), "completed": len(done), "lost": len(samples) - len(done),
           "errors_4xx": sum(400 <= s.status < 500 for s in samples),
           "errors_5xx": sum(s.status >= 500 or "server_error" in (s.error or "") for s in samples)}
    return {**out, **summarize(done, wall_s, slo["ttft_s"], slo["tpot_s"],
                               output_tokens=sum(s.completion_tokens for s in done), sent=len(samples))}


@contextmanager
def server_process(model: str, threads: int, *options: str, timeout: float = 300.0):
    """`minillm serve` on a free 127.0.0.1 port in a subprocess; yields its URL; always stopped (SIGINT: it drains)."""
    root = str(Path(__file__).resolve().parents[2])  # the checkout, importable whether or not it is installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "minillm.cli", "serve", "--model", model, "--port", "0", "--threads", str(threads),
           "--log-level", "warning", "--drain-timeout", "5", *options]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines, ready = [], threading.Event()

    def read() -> None:  # keep draining its output: a full pipe would block the server
        for line in proc.stdout:
            lines.append(line.rstrip())
            if "ready at" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + timeout
        while not ready.wait(0.2):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("minillm serve did not start:\n" + "\n".join(lines[-20:]))
        url = re.search(r"ready at (\S+)/v1", next(x for x in lines if "ready at" in x)).group(1)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def cache_counts(url: str) -> tuple[int, int] | None:
    """(prompt tokens asked for, tokens found in the prefix cache) so far, from /health; None if not reported."""
    import httpx2 as httpx

    cache = httpx.get(url + "/health", timeout=10).json().get("prefix_cache")
    return (cache["query_tokens"], cache["hit_tokens"]) if cache else None


def _measure(url: str, workload: str, reqs, rate: float) -> dict:
    """One Poisson run, summarized, with the prefix-cache hit rate of its prompts when the server reports it."""
    before = cache_counts(url)
    summary = summarize_load(*asyncio.run(run_load(url, reqs, rate=rate, seed=1, workload=workload)))
    after = cache_counts(url)
    summary["prefix_hit_rate"] = ((after[1] - before[1]) / max(after[0] - before[0], 1) if before and after
                                  else float("nan"))
    return summary


def _row(workload: str, rate, summary: dict) -> dict:
    cols = ("sent", "completed", "lost", "errors_4xx", "errors_5xx", "requests_per_s", "output_tok_per_s",
            "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90", "tpot_p99", "itl_p50", "itl_p99",
            "e2e_p50", "e2e_p99", "goodput_req_per_s", "slo_attained", "prefix_hit_rate")
    return {"workload": workload, "rate": rate, **{c: summary[c] for c in cols}}


def overhead(url: str, model, tok, requests, engine: dict) -> tuple[dict, dict]:
    """The same requests one at a time through HTTP (client-side timing) and through `LLM.generate` in this process
    (engine timestamps), alternating A B B A so that a machine that slows down or speeds up meanwhile hits both
    alike. The server is idle while the in-process engine runs: the two never compute at the same time."""
    from minillm.engine import LLM
    from minillm.sampling import SamplingParams

    llm = LLM.from_model(model, tok, **engine)
    prompts = [tok.encode_chat(b["messages"]) if "messages" in b else tok.encode(b["prompt"]) for _, b in requests]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up, as the server had one
    served, alone = {"tpot": [], "e2e": [], "tokens": 0, "s": 0.0}, {"tpot": [], "e2e": [], "tokens": 0, "s": 0.0}

    def http(i: int) -> None:
        (x,), wall = asyncio.run(run_load(url, requests[i:i + 1], concurrency=1, workload="overhead"))
        m = x.metrics
        served["tpot"].append(m["tpot"]), served["e2e"].append(m["e2e"])
        served["tokens"], served["s"] = served["tokens"] + x.completion_tokens, served["s"] + wall

    def engine_(i: int) -> None:
        params = SamplingParams(max_tokens=requests[i][1]["max_tokens"], ignore_eos=True)
        with timer() as t:
            out = llm.generate([prompts[i]], params)[0]
        alone["tpot"].append(out.metrics["tpot"]), alone["e2e"].append(out.metrics["e2e"])
        alone["tokens"], alone["s"] = alone["tokens"] + len(out.token_ids), alone["s"] + t.seconds

    for i in range(len(requests)):
        for f in ((http, engine_) if i % 2 == 0 else (engine_, http)):
            f(i)
    return tuple({"tpot_mean": sum(d["tpot"]) / len(d["tpot"]), "e2e_mean": sum(d["e2e"]) / len(d["e2e"]),
                  "output_tok_per_s": d["tokens"] / d["s"]} for d in (served, alone))


def run(quick: bool = False, url: str | None = None, rate: float | list[float] | None = None,
        model: str = "smollm2-135m", max_num_seqs: int = 16) -> BenchResult:
    from concurrent.futures import ThreadPoolExecutor
    from contextlib import nullcontext

    from minillm.api import load_model
    from minillm.gguf.tokenizer import Tokenizer
    from minillm.gguf.weights import gguf_path, read_gguf_metadata

    threads = torch.get_num_threads()
    if quick:
        sweep, plan, out_len, n_overhead = [2.0], {}, 8, 2
    else:
        # rates well past the capacity: a 2-core CPU completed at most ~1.6 short chats/s in an earlier run
        sweep, out_len, n_overhead = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0], 32, 6
        plan = {"shared-system": (0.5, 12), "long-doc": (0.1, 6)}  # workload -> (rate, requests)
    if rate is not None:
        sweep = sorted(rate) if isinstance(rate, (list, tuple)) else [float(rate)]
    n_sweep = {r: 4 if quick else requests_at(r) for r in sweep}
    own = url is None
    url = None if own else url.rstrip("/").removesuffix("/v1")  # the server's root, however it was written
    engine = {"max_num_seqs": max_num_seqs, "enable_prefix_caching": True}  # minillm serve's defaults
    # the sweep studies a queue, not load shedding: room for every request to wait (past max_waiting, 429s)
    options = ("--max-num-seqs", str(max_num_seqs), "--max-waiting", str(max(64, *n_sweep.values())))
    rows, series = [], {"workload": "short-chat"}
    with ThreadPoolExecutor(1) as pool:
        # the model loads here while the server loads in its own process: the prompts need its tokenizer, the
        # in-process comparison its weights
        loading = pool.submit(load_model, model, dtype="float32", device="cpu") if own else None
        with server_process(model, threads, *options) if own else nullcontext(url) as base:
            m, tok = loading.result() if own else (None, Tokenizer.from_gguf_metadata(
                read_gguf_metadata(gguf_path(model))))
            asyncio.run(run_load(base, make_requests(tok, "short-chat", 1, 2, model, seed=99), concurrency=1))
            for r in sweep:  # (the warm-up above: a fresh server's first forward pays one-off costs)
                reqs = make_requests(tok, "short-chat", n_sweep[r], out_len, model, seed=int(r * 100))
                s = _measure(base, "short-chat", reqs, r)
                rows.append(_row("short-chat", r, s))
                for k in ("sent", "requests_per_s", "output_tok_per_s", "ttft_p50", "ttft_p99", "tpot_p50",
                          "tpot_p99", "itl_p99", "e2e_p50", "goodput_req_per_s", "slo_attained", "lost"):
                    series.setdefault(k, []).append(s[k])
                series.setdefault("rate", []).append(r)
            for w, (r, n) in plan.items():
                reqs = make_requests(tok, w, n, 16 if w == "long-doc" else out_len, model, seed=7)
                rows.append(_row(w, r, _measure(base, w, reqs, r)))
            if own:
                oreqs = make_requests(tok, "short-chat", n_overhead, out_len, model, seed=5)
                served, alone = overhead(base, m, tok, oreqs, engine)
    ratios = {"lost_requests": float(sum(r["lost"] for r in rows)),
              "server_errors_5xx": float(sum(r["errors_5xx"] for r in rows))}
    targets = {"lost_requests": ("<=", 0), "server_errors_5xx": ("<=", 0)}
    sizes = ", ".join(f"{n} at {r:g}" for r, n in n_sweep.items())
    notes = [(f"client-side measurement (httpx2 streaming SSE); outputs of exactly {out_len} tokens (vLLM's "
              f"ignore_eos); greedy; Poisson arrivals; goodput SLO: TTFT <= {SLO['ttft_s']} s and TPOT <= "
              f"{SLO['tpot_s']} s; lost = sent - completed with a finish_reason and [DONE]."),
             (f"short-chat requests per rate (req/s): {sizes}"
              + ("" if quick else f": about {ARRIVAL_WINDOW_S:g} s of arrivals each (at least {MIN_REQUESTS}), "
                 f"so that past the server's capacity a queue forms; {max_num_seqs} slots (max_num_seqs)") + "."),
             ("workloads: short-chat = one user message of 16-64 tokens of pydoc text; shared-system = one 480-token "
              "system prompt shared by every request + 8-32 user tokens; long-doc = 768-1024 tokens to continue "
              "(16 output tokens).")]
    if own:
        for name, x in (("overhead: through the server", served), ("overhead: LLM.generate in-process", alone)):
            rows.append({"workload": name, "rate": "1 at a time", "output_tok_per_s": x["output_tok_per_s"],
                         "tpot_mean": x["tpot_mean"], "e2e_mean": x["e2e_mean"]})
        ratios["server_vs_inprocess_tpot"] = served["tpot_mean"] / alone["tpot_mean"]
        ratios["server_vs_inprocess_e2e"] = served["e2e_mean"] / alone["e2e_mean"]
        targets["server_vs_inprocess_tpot"] = ("<=", 1.15)
        notes.append(f"overhead: {n_overhead} short chats one at a time through HTTP (client-side) and through "
                     f"LLM.generate in this process (engine timestamps), alternated ABBA, same engine settings; per "
                     f"token the server adds {(served['tpot_mean'] - alone['tpot_mean']) * 1e3:.1f} ms.")
    else:
        notes.append(f"server at {url} (not started here): no in-process comparison.")
    return BenchResult(name="serve", rows=rows, ratios=ratios, targets=targets, series=series, notes=notes,
                       settings={"quick": quick, "model": model, "url": url or "own minillm serve subprocess",
                                 "rates": sweep, "requests_per_rate": list(n_sweep.values()),
                                 "output_tokens": out_len,
                                 **({"engine": engine} if own else {}), "threads": threads,
                                 "slo_ttft_s": SLO["ttft_s"], "slo_tpot_s": SLO["tpot_s"], "device": "cpu"})
