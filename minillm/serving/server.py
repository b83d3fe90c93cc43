"""An OpenAI-compatible HTTP server around the engine (lesson 12): `minillm serve`, then any OpenAI client.

    minillm serve --port 8000
    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")

POST /v1/completions and /v1/chat/completions (Server-Sent Events with `stream: true`), GET /v1/models, /health
and /metrics (Prometheus text), POST /tokenize; the wire format is openai_protocol.py; who may call, access.py.
vLLM's shape: one `EngineThread` owns the engine and steps it, the asyncio loop parses and streams. A full queue
gets 429, a client that leaves aborts, shutdown drains.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
import time
import uuid
from concurrent.futures import Future
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from minillm.engine.llm import StreamEvent
from minillm.sampling import SamplingParams
from minillm.serving.access import AccessGuard, AccessPolicy
from minillm.serving.openai_protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    StopMatcher,
    TokenizeRequest,
    chat_body,
    chunk,
    completion_body,
    read_request,
    sampling_params,
    usage,
)

logger = logging.getLogger("minillm.serving.server")


class QueueFull(Exception):
    pass


class _Sink:
    """Where the engine puts one request's StreamEvents (on the engine thread): forwarded to the event loop."""

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

    def __init__(self, llm, max_waiting: int):
        self.llm, self.max_waiting = llm, max_waiting
        self.wake = threading.Event()
        self.inbox: collections.deque = collections.deque()  # (function, args, Future), run between steps
        self.retired: collections.deque = collections.deque()  # ids whose last event went out
        self.in_flight: dict[str, _Sink] = {}  # added here, removed once retired: changed by this thread only
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

    def add(self, prompt_ids: list[int], params: SamplingParams, rid: str, sink: _Sink) -> None:
        # backpressure: a 429 at once (a load balancer can send it elsewhere), not a queue that only grows
        if len(self.llm.scheduler.waiting) >= self.max_waiting:
            raise QueueFull(f"{self.max_waiting} requests are already waiting for the engine: retry later")
        self.llm.add_request(prompt_ids, params, request_id=rid, sink=sink)
        self.in_flight[rid] = sink

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
                    self.llm.pop_output(rid)
                except KeyError:
                    pass
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


class _EventStream(StreamingResponse):
    """An SSE response that runs `on_close` however it ends: done, client gone, or cancelled by the server. (A
    generator's `finally` is not enough: a client that leaves before the first chunk means the body never starts.)"""

    def __init__(self, body, on_close):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class Service:
    """What the endpoints do: validate, submit to the engine thread, turn its events into OpenAI responses."""

    def __init__(self, llm, model_name: str, max_waiting: int):
        self.llm, self.model_name = llm, model_name
        self.engine = EngineThread(llm, max_waiting)
        self.closing, self.open = False, 0  # open: accepted requests whose response has not ended yet
        self.counts = collections.Counter()  # /metrics: requests, prompt and generated tokens, finish reasons

    async def submit(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> asyncio.Queue:
        if self.closing:
            raise ApiError(503, "the server is shutting down", "server_error", code="shutting_down")
        if self.engine.error is not None:
            raise ApiError(500, f"the engine failed: {self.engine.error!r}", "server_error")
        sink = _Sink(asyncio.get_running_loop(), self.engine)
        try:
            await asyncio.wrap_future(self.engine.post(self.engine.add, prompt_ids, params, rid, sink))
        except QueueFull as e:
            raise ApiError(429, str(e), "rate_limit_error", code="queue_full") from None
        except (ValueError, TypeError) as e:
            raise ApiError(400, str(e)) from None
        except asyncio.CancelledError:
            self.engine.post(self.llm.abort, rid)
            raise
        return sink.queue

    def aborted(self) -> ApiError:
        if self.engine.error is not None:
            return ApiError(500, f"the engine failed: {self.engine.error!r}", "server_error")
        return ApiError(503, "the request was aborted: the server is shutting down", "server_error",
                        code="aborted")

    async def deltas(self, rid: str, queue: asyncio.Queue, stops: list[str]):
        """(text, finish_reason or None, tokens so far) for one request, stop strings applied."""
        matcher, n = StopMatcher(stops), 0
        while True:
            ev = await queue.get()
            n += ev.token_id is not None
            text, hit = matcher.push(ev.text)
            if hit:  # the engine does not know about stop strings: end the request here
                self.engine.post(self.llm.abort, rid)
                self.counts["generation_tokens"] += n
                self.counts["finished stop"] += 1
                yield text, "stop", n
                return
            if ev.finished:
                self.counts["generation_tokens"] += n
                self.counts[f"finished {ev.finish_reason}"] += 1
                yield text + matcher.flush(), ev.finish_reason, n
                return
            yield text, None, n

    async def respond(self, request: Request, req, prompt_ids: list[int], chat: bool, max_tokens: int | None):
        pool = self.llm.block_manager.num_blocks * self.llm.block_manager.block_size
        params = sampling_params(req, self.model_name, max_tokens, len(prompt_ids), self.llm.max_model_len, pool)
        stops = req.stop_strings()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        queue = await self.submit(rid, prompt_ids, params)
        self.counts["requests"] += 1
        self.counts["prompt_tokens"] += len(prompt_ids)
        self.open += 1
        closed = False

        def close() -> None:  # idempotent; aborting a request that already ended does nothing
            nonlocal closed
            if not closed:
                closed = True
                self.open -= 1
                self.engine.post(self.llm.abort, rid)

        if req.stream:
            with_usage = req.stream_options is not None and req.stream_options.include_usage
            return _EventStream(self.sse(rid, queue, stops, chat, len(prompt_ids), with_usage), close)
        try:
            return await self.collect(request, rid, queue, stops, chat, len(prompt_ids))
        finally:
            close()

    async def sse(self, rid, queue, stops, chat, n_prompt, with_usage):
        def data(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        if chat:  # OpenAI's first chat chunk announces the role
            yield data(chunk(rid, self.model_name, True, "", None, role=True, with_usage=with_usage))
        async for text, finish, n in self.deltas(rid, queue, stops):
            if finish == "abort":  # the stream still ends cleanly: an error event, then [DONE]
                yield data(self.aborted().body())
            elif text or finish:
                yield data(chunk(rid, self.model_name, chat, text, finish, with_usage=with_usage))
            if finish is not None and finish != "abort" and with_usage:
                yield data(chunk(rid, self.model_name, chat, None, None, usage(n_prompt, n), with_usage=True))
        yield "data: [DONE]\n\n"

    async def collect(self, request, rid, queue, stops, chat, n_prompt) -> JSONResponse:
        parts, end = [], (None, 0)

        async def run() -> None:
            nonlocal end
            async for text, finish, n in self.deltas(rid, queue, stops):
                parts.append(text)
                end = (finish, n)

        task = asyncio.ensure_future(run())
        try:
            while not task.done():  # nothing cancels a plain request when its client leaves: look every 0.5 s
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await request.is_disconnected():
                    return JSONResponse({}, status_code=499)  # nobody reads it; the caller's close() aborts
        finally:
            task.cancel()
        finish, n = end
        if finish == "abort":
            raise self.aborted()
        body = chat_body if chat else completion_body
        return JSONResponse(body(rid, self.model_name, "".join(parts), finish, usage(n_prompt, n)))

    async def drain(self, timeout: float) -> None:
        """Refuse new requests, let those in flight finish for `timeout` s, abort the rest (their streams end with an
        error event), and give the responses a moment to write their last bytes."""
        self.closing = True
        deadline = time.monotonic() + timeout
        while self.engine.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.engine.in_flight and self.engine.is_alive():
            n = await asyncio.wrap_future(self.engine.post(self.engine.abort_all))
            logger.warning("shutdown: aborted %d request(s) still in flight after %.1f s", n, timeout)
        deadline = time.monotonic() + 5.0
        while self.open and time.monotonic() < deadline:
            await asyncio.sleep(0.02)


def build_app(llm, model_name: str = "smollm2-135m", max_waiting: int = 64, max_body_bytes: int = 1 << 20,
              access: AccessPolicy | None = None) -> FastAPI:
    """The FastAPI app around an `LLM` (minillm.engine.LLM or LLM.from_model); its engine thread starts and stops with
    the app (lifespan). max_waiting: requests allowed to wait in the engine before 429. access: who may call
    (access.py; default: loopback Host names, no foreign web origin, no API key)."""
    if llm.tokenizer is None:
        raise ValueError("the server needs an LLM with a tokenizer (LLM.from_model(model, tokenizer))")
    svc = Service(llm, model_name, max_waiting)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        svc.engine.start()
        yield
        await svc.drain(0.0)  # Server.shutdown drained already; a bare ASGI host did not
        await asyncio.to_thread(svc.engine.stop)

    app = FastAPI(title="minillm", lifespan=lifespan)
    app.add_middleware(AccessGuard, policy=access or AccessPolicy())
    app.state.service = svc
    tok = llm.tokenizer

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)  # 404 / 405 in OpenAI's shape too
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await read_request(request, CompletionRequest, max_body_bytes)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(400, f"one prompt per request (a string or a list of token ids), got a list of "
                               f"{len(prompt)} prompts: send them as separate requests", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ApiError(400, "the prompt is empty", param="prompt")
            prompt = await asyncio.to_thread(tok.encode, prompt)
        elif not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        return await svc.respond(request, req, prompt, chat=False, max_tokens=req.max_tokens)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await read_request(request, ChatRequest, max_body_bytes)
        messages = [{"role": m.template_role(), "content": m.text()} for m in req.messages]
        try:  # message contents are encoded as text: "<|im_start|>" typed by a user is not a special token
            ids = await asyncio.to_thread(tok.encode_chat, messages)
        except (ValueError, TypeError) as e:
            raise ApiError(400, str(e), param="messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return await svc.respond(request, req, ids, chat=True, max_tokens=max_tokens)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "minillm",
                                            "max_model_len": llm.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        """vLLM's /tokenize: {"prompt": text} or {"messages": [...]} (through the chat template) -> the token ids."""
        req = await read_request(request, TokenizeRequest, max_body_bytes)
        if req.messages is not None:
            ids = await asyncio.to_thread(tok.encode_chat, [{"role": m.template_role(), "content": m.text()}
                                                            for m in req.messages])
        elif req.prompt is not None:
            ids = await asyncio.to_thread(tok.encode, req.prompt)
        else:
            raise ApiError(400, "give a 'prompt' (text) or 'messages' (a chat) to tokenize", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.max_model_len}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        """Prometheus text: what a dashboard polls (counters since start, gauges now)."""
        c, cache = svc.counts, llm.prefix_cache_stats
        lines = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP minillm_{name} {help_}", f"# TYPE minillm_{name} {kind}"])
            lines.extend(f"minillm_{name}{labels} {value:g}" for labels, value in samples)

        metric("requests_total", "counter", "requests accepted by the engine", [("", c["requests"])])
        metric("prompt_tokens_total", "counter", "prompt tokens of accepted requests", [("", c["prompt_tokens"])])
        metric("generation_tokens_total", "counter", "tokens generated", [("", c["generation_tokens"])])
        metric("requests_finished_total", "counter", "requests ended, by finish_reason",
               [(f'{{finish_reason="{k.split()[1]}"}}', v) for k, v in sorted(c.items()) if k.startswith("finished")])
        metric("requests_running", "gauge", "requests in the engine", [("", len(svc.engine.in_flight))])
        metric("requests_waiting", "gauge", "requests waiting for a slot", [("", len(llm.scheduler.waiting))])
        used = llm.block_manager.num_blocks - llm.num_free_blocks()
        metric("kv_blocks_used", "gauge", "KV-cache blocks holding a running sequence's tokens", [("", used)])
        metric("kv_blocks_total", "gauge", "KV-cache blocks in the pool", [("", llm.block_manager.num_blocks)])
        if cache is not None:
            metric("prefix_cache_hit_rate", "gauge", "prompt tokens found in the prefix cache / prompt tokens",
                   [("", cache.hit_rate)])
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = not svc.closing and svc.engine.error is None and svc.engine.is_alive()
        cache = llm.prefix_cache_stats  # None without prefix caching
        return JSONResponse({"status": "ok" if ok else "unavailable", "in_flight": len(svc.engine.in_flight),
                             "waiting": len(llm.scheduler.waiting), "free_blocks": llm.num_free_blocks(),
                             "num_blocks": llm.block_manager.num_blocks,
                             "prefix_cache": cache.as_dict() if cache is not None else None},
                            status_code=200 if ok else 503)

    return app


class Server(uvicorn.Server):
    """uvicorn with a draining shutdown (Service.drain before uvicorn closes connections) and a ready line."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 8000, drain_timeout: float = 30.0,
                 log_level: str = "info", announce: bool = False):
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                        timeout_graceful_shutdown=drain_timeout + 10))
        self.app, self.drain_timeout, self.announce = app, drain_timeout, announce

    @property
    def url(self) -> str:
        host, port = self.servers[0].sockets[0].getsockname()[:2]  # the real port, also when asked for port 0
        return f"http://{host}:{port}"

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.announce:
            print(f"minillm serve: ready at {self.url}/v1", flush=True)

    async def shutdown(self, sockets=None) -> None:
        await self.app.state.service.drain(self.drain_timeout)
        await super().shutdown(sockets)


def serve(llm, model_name: str = "smollm2-135m", host: str = "127.0.0.1", port: int = 8000, max_waiting: int = 64,
          drain_timeout: float = 30.0, log_level: str = "info", access: AccessPolicy | None = None) -> None:
    """Serve `llm` over HTTP until interrupted (Ctrl-C / SIGTERM drain it, see Server)."""
    Server(build_app(llm, model_name, max_waiting, access=access), host, port, drain_timeout, log_level,
           announce=True).run()
