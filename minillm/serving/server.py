"""An OpenAI-compatible HTTP server around the engine (lesson 12): `minillm serve`, then any OpenAI client.

    minillm serve --port 8000
    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")

POST /v1/completions and /v1/chat/completions (Server-Sent Events with `stream: true`), GET /v1/models, /health
and /metrics (Prometheus text), POST /tokenize; the wire format is openai_protocol.py; who may call, access.py.
vLLM's shape (a thread steps the engine, the asyncio loop parses and streams; 429, aborts, draining): `Service`.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import NamedTuple

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from minillm.engine.output import sample_ids
from minillm.sampling import SamplingParams
from minillm.serving.access import AccessGuard, AccessPolicy
from minillm.serving.engine_thread import AsyncSink, EngineThread, QueueFull
from minillm.serving.openai_protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    LogprobsWriter,
    StopMatcher,
    TokenizeRequest,
    body,
    choice,
    chunk,
    read_request,
    sampling_params,
    usage,
)

logger = logging.getLogger("minillm.serving.server")


class Delta(NamedTuple):
    """What one engine event adds to a choice of an answer."""

    index: int  # the choice
    text: str  # text to send (stop strings cut, a possible one held back)
    finish: str | None  # "stop" | "length" | "abort" on the choice's last delta
    token: tuple | None  # (id, logprob, top_logprobs) of the token, None for an abort
    n: int  # the choice's tokens so far


@dataclass
class _Call:
    """One HTTP request in flight: its n choices' engine ids and event queue, and how to answer."""

    rid: str
    ids: list[str]  # choice i is engine request ids[i]
    queue: asyncio.Queue  # every choice's StreamEvents
    stops: list[str]
    chat: bool
    n_prompt: int
    min_tokens: int  # stop strings count from this many tokens on
    writers: list[LogprobsWriter] | None  # one per choice, when logprobs were asked for


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
    """What the endpoints do: validate, submit to the engine thread, turn its events into OpenAI responses.

    vLLM's shape: one `EngineThread` (engine_thread.py) owns the engine and steps it, the asyncio loop parses and
    streams. A full queue gets 429, a client that leaves aborts, shutdown drains. `n` choices are n engine sequences
    sharing the prompt (LLM.add_samples); logprobs come with the engine's events (LogprobsWriter).
    """

    def __init__(self, llm, model_name: str, max_waiting: int):
        self.llm, self.model_name = llm, model_name
        self.engine = EngineThread(llm, max_waiting)
        self.closing, self.open = False, 0  # open: accepted requests whose response has not ended yet
        self.counts = collections.Counter()  # /metrics: requests, prompt and generated tokens, finish reasons

    async def submit(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> asyncio.Queue:
        """Queue the request's params.n sequences (sample_ids(rid, n)); their events arrive in one queue."""
        if self.closing:
            raise ApiError(503, "the server is shutting down", "server_error", code="shutting_down")
        if self.engine.error is not None:
            raise ApiError(500, f"the engine failed: {self.engine.error!r}", "server_error")
        sink = AsyncSink(asyncio.get_running_loop(), self.engine)
        try:
            await asyncio.wrap_future(self.engine.post(self.engine.add, prompt_ids, params, rid, sink))
        except QueueFull as e:
            raise ApiError(429, str(e), "rate_limit_error", code="queue_full") from None
        except (ValueError, TypeError) as e:
            raise ApiError(400, str(e)) from None
        except asyncio.CancelledError:
            self.abort(sample_ids(rid, params.n))
            raise
        return sink.queue

    def abort(self, ids: list[str]) -> None:
        for rid in ids:  # aborting a request that already ended does nothing
            self.engine.post(self.llm.abort, rid)

    def aborted(self) -> ApiError:
        if self.engine.error is not None:
            return ApiError(500, f"the engine failed: {self.engine.error!r}", "server_error")
        return ApiError(503, "the request was aborted: the server is shutting down", "server_error",
                        code="aborted")

    async def deltas(self, call: _Call):
        """A Delta per engine event of the call's choices, stop strings applied (from min_tokens on); ends when
        every choice has finished."""
        index = {rid: i for i, rid in enumerate(call.ids)}
        matchers, counts, live = [StopMatcher(call.stops) for _ in call.ids], [0] * len(call.ids), set(index.values())
        while live:
            ev = await call.queue.get()
            i = index[ev.request_id]
            if i not in live:  # a choice a stop string ended: its abort event, or tokens that were on their way
                continue
            token = None
            if ev.token_id is not None:
                counts[i] += 1
                token = (ev.token_id, ev.logprob, ev.top_logprobs)
            text, hit = matchers[i].push(ev.text, active=counts[i] >= call.min_tokens)
            if hit:  # the engine does not know about stop strings: end this choice here
                self.engine.post(self.llm.abort, ev.request_id)
            elif ev.finished:
                text += matchers[i].flush()
            finish = "stop" if hit else ev.finish_reason if ev.finished else None
            if finish is not None:
                live.discard(i)
                self.counts["generation_tokens"] += counts[i]
                self.counts[f"finished {finish}"] += 1
            yield Delta(i, text, finish, token, counts[i])

    async def respond(self, request: Request, req, prompt_ids: list[int], chat: bool, max_tokens: int | None):
        pool = self.llm.block_manager.num_blocks * self.llm.block_manager.block_size
        params = sampling_params(req, self.model_name, max_tokens, len(prompt_ids), self.llm.max_model_len, pool)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        ids, stops = sample_ids(rid, params.n), req.stop_strings()
        writers = [LogprobsWriter(self.llm.tokenizer, chat) for _ in ids] if params.logprobs else None
        call = _Call(rid, ids, await self.submit(rid, prompt_ids, params), stops, chat, len(prompt_ids),
                     params.min_tokens, writers)
        self.counts["requests"] += 1
        self.counts["prompt_tokens"] += len(prompt_ids)
        self.open += 1
        closed = False

        def close() -> None:  # idempotent
            nonlocal closed
            if not closed:
                closed = True
                self.open -= 1
                self.abort(ids)

        if req.stream:
            with_usage = req.stream_options is not None and req.stream_options.include_usage
            return _EventStream(self.sse(call, with_usage), close)
        try:
            return await self.collect(request, call)
        finally:
            close()

    async def sse(self, call: _Call, with_usage: bool):
        def data(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        def make(*args, **kwargs) -> str:
            return data(chunk(call.rid, self.model_name, call.chat, *args, with_usage=with_usage, **kwargs))

        if call.chat:  # OpenAI's first chunk of each chat choice announces the role
            for i in range(len(call.ids)):
                yield make("", None, role=True, index=i)
        pending, counts = [[] for _ in call.ids], [0] * len(call.ids)  # pending: tokens whose logprobs wait
        async for d in self.deltas(call):
            if d.finish == "abort":  # the stream still ends cleanly: an error event, then [DONE]
                yield data(self.aborted().body())
                break
            counts[d.index] = d.n
            if d.token is not None:
                pending[d.index].append(d.token)
            if d.text or d.finish:  # a chunk carries the logprobs of the tokens since the last one of its choice
                logprobs = call.writers[d.index].write(pending[d.index]) if call.writers else None
                pending[d.index] = []
                yield make(d.text, d.finish, index=d.index, logprobs=logprobs)
        else:  # every choice ended (no abort)
            if with_usage:
                yield make(None, None, usage(call.n_prompt, sum(counts)))
        yield "data: [DONE]\n\n"

    async def collect(self, request, call: _Call) -> JSONResponse:
        n = len(call.ids)
        texts, tokens, ends = [[] for _ in range(n)], [[] for _ in range(n)], [(None, 0)] * n

        async def run() -> None:
            async for d in self.deltas(call):
                texts[d.index].append(d.text)
                if d.token is not None:
                    tokens[d.index].append(d.token)
                if d.finish is not None:
                    ends[d.index] = (d.finish, d.n)
                if d.finish == "abort":
                    return

        task = asyncio.ensure_future(run())
        try:
            while not task.done():  # nothing cancels a plain request when its client leaves: look every 0.5 s
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await request.is_disconnected():
                    return JSONResponse({}, status_code=499)  # nobody reads it; the caller's close() aborts
        finally:
            task.cancel()
        task.result()  # what went wrong in run(), if anything
        if any(finish == "abort" for finish, _ in ends):
            raise self.aborted()
        choices = [choice(call.chat, i, "".join(texts[i]), ends[i][0],
                          call.writers[i].write(tokens[i]) if call.writers else None) for i in range(n)]
        return JSONResponse(body(call.rid, self.model_name, call.chat, choices,
                                 usage(call.n_prompt, sum(k for _, k in ends))))

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
