"""An OpenAI-compatible HTTP server around the engine (lesson 12): `minillm serve`, then any OpenAI client.

    minillm serve --port 8000
    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")

POST /v1/completions, /v1/chat/completions (SSE with `stream: true`), /tokenize; GET /v1/models, /health, /metrics
(metrics.py). Wire format: openai_protocol.py; who may call: access.py; for how long: connections.py. vLLM's
shape (a thread steps the engine, the asyncio loop parses and streams; 429, aborts, draining): `Service`.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import NamedTuple

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from minillm.engine.output import sample_ids
from minillm.sampling import SamplingParams
from minillm.serving.access import AccessGuard, AccessPolicy
from minillm.serving.connections import ConnectionLimits
from minillm.serving.engine_thread import AsyncSink, EngineThread, QueueFull
from minillm.serving.metrics import ServerMetrics
from minillm.serving.openai_protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    LogprobsWriter,
    TokenizeRequest,
    body,
    choice,
    chunk,
    encode_json,
    extend_logprobs,
    read_request,
    sampling_params,
    usage,
)
from minillm.serving.router_endpoints import add_router_endpoints
from minillm.serving.schema import GENERATE, SSE, WHY, ChatCompletion, Completion, Health, ModelList, TokenizeResponse
from minillm.serving.schema import install as install_schema
from minillm.serving.schema import responses
from minillm.serving.stop_strings import StopMatcher

logger = logging.getLogger("minillm.serving.server")
YIELD_EVERY_S = 0.005  # the most one request's work holds the event loop before other requests get a turn


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
    finishes: list[str | None]  # each choice's finish_reason once the client has it (deltas)


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

    def __init__(self, llm, model_name: str, max_waiting: int, body_timeout: float):
        self.llm, self.model_name, self.body_timeout = llm, model_name, body_timeout  # body: seconds, then 408
        self.metrics = ServerMetrics()  # /metrics (metrics.py)
        self.engine = EngineThread(llm, max_waiting, on_retire=self.metrics.retired)
        self.closing, self.open = False, 0  # open: accepted requests whose response has not ended yet

    async def submit(self, rid: str, prompt_ids: list[int], params: SamplingParams, arrival: float) -> asyncio.Queue:
        """Queue the request's params.n sequences (sample_ids(rid, n)); their events arrive in one queue."""
        if self.closing:
            raise ApiError(503, "the server is shutting down", "server_error", code="shutting_down")
        if self.engine.error is not None:
            raise ApiError(500, f"the engine failed: {self.engine.error!r}", "server_error")
        sink = AsyncSink(asyncio.get_running_loop(), self.engine)
        try:
            await asyncio.wrap_future(self.engine.post(self.engine.add, prompt_ids, params, rid, sink, arrival))
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
        first = StopMatcher(call.stops)  # the choices share its tables (built per request, on this loop)
        matchers = [first] + [StopMatcher(call.stops, first.tables) for _ in call.ids[1:]]
        counts, live, t0 = [0] * len(call.ids), set(index.values()), time.perf_counter()
        while live:
            if time.perf_counter() - t0 > YIELD_EVERY_S:  # a backlog (n choices' events) would not yield:
                await asyncio.sleep(0)  # get() on a queue that has an item returns without letting others run
                t0 = time.perf_counter()
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
                call.finishes[i] = finish
            yield Delta(i, text, finish, token, counts[i])

    async def respond(self, request: Request, req, prompt_ids: list[int], chat: bool, max_tokens: int | None,
                      arrival: float):
        """arrival: when the request came in (time.perf_counter()), for its time to first token."""
        pool = self.llm.block_manager.num_blocks * self.llm.block_manager.block_size
        params = sampling_params(req, self.model_name, max_tokens, len(prompt_ids), self.llm.max_model_len, pool)
        if params.n > self.engine.max_waiting:  # its n samples all wait in the engine's queue: it would never fit
            raise ApiError(400, f"n is {params.n}, and this server lets {self.engine.max_waiting} requests wait "
                           f"(minillm serve --max-waiting): ask for at most that many choices", param="n")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        ids, stops = sample_ids(rid, params.n), req.stop_strings()
        writers = [LogprobsWriter(self.llm.tokenizer, chat) for _ in ids] if params.logprobs else None
        call = _Call(rid, ids, await self.submit(rid, prompt_ids, params, arrival), stops, chat, len(prompt_ids),
                     params.min_tokens, writers, [None] * len(ids))
        self.metrics.accepted(len(ids), len(prompt_ids))
        self.open += 1
        closed = False

        def close() -> None:  # idempotent; however the response ended, each choice is counted once
            nonlocal closed
            if not closed:
                closed = True
                self.open -= 1
                self.abort(ids)
                self.metrics.ended(call.finishes, failed=self.engine.error is not None)

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

    async def collect(self, request, call: _Call) -> Response:
        """The whole answer: logprobs written as their tokens come, the JSON encoded in slices (encode_json), so
        a large answer never holds the event loop for long."""
        n = len(call.ids)
        texts, ends = [[] for _ in range(n)], [(None, 0)] * n
        logprobs = [w.write([]) for w in call.writers] if call.writers else None  # each choice's, so far

        async def run() -> None:
            async for d in self.deltas(call):
                texts[d.index].append(d.text)
                if d.token is not None and logprobs:
                    extend_logprobs(logprobs[d.index], call.writers[d.index].write([d.token]))
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
                          logprobs[i] if logprobs else None) for i in range(n)]
        answer = body(call.rid, self.model_name, call.chat, choices, usage(call.n_prompt, sum(k for _, k in ends)))
        return Response(await encode_json(answer), media_type="application/json")

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
              access: AccessPolicy | None = None, body_timeout: float = ConnectionLimits.body_timeout) -> FastAPI:
    """The FastAPI app around an `LLM` (minillm.engine.LLM or LLM.from_model); its engine thread starts and stops with
    the app (lifespan). max_waiting: requests allowed to wait in the engine before 429. access: who may call
    (access.py; default: loopback Host names, no foreign web origin, no API key). body_timeout: seconds a request's
    body may take to arrive (408; a Server sets it from its ConnectionLimits)."""
    if llm.tokenizer is None:
        raise ValueError("the server needs an LLM with a tokenizer (LLM.from_model(model, tokenizer))")
    svc = Service(llm, model_name, max_waiting, body_timeout)

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
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)  # 404 / 405 in OpenAI's shape too
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.post("/v1/completions", responses={200: {"model": Completion, "content": SSE}, **responses(*GENERATE)})
    async def completions(request: Request):
        arrival = time.perf_counter()
        req = await read_request(request, CompletionRequest, max_body_bytes, svc.body_timeout)
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
        return await svc.respond(request, req, prompt, chat=False, max_tokens=req.max_tokens, arrival=arrival)

    @app.post("/v1/chat/completions", responses={200: {"model": ChatCompletion, "content": SSE},
                                                 **responses(*GENERATE)})
    async def chat_completions(request: Request):
        arrival = time.perf_counter()
        req = await read_request(request, ChatRequest, max_body_bytes, svc.body_timeout)
        messages = [{"role": m.template_role(), "content": m.text()} for m in req.messages]
        try:  # message contents are encoded as text: "<|im_start|>" typed by a user is not a special token
            ids = await asyncio.to_thread(tok.encode_chat, messages)
        except (ValueError, TypeError) as e:
            raise ApiError(400, str(e), param="messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return await svc.respond(request, req, ids, chat=True, max_tokens=max_tokens, arrival=arrival)

    @app.get("/v1/models", response_model=ModelList, responses=responses(401))
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "minillm",
                                            "max_model_len": llm.max_model_len}]}

    @app.post("/tokenize", response_model=TokenizeResponse, responses=responses(400, 408, 413, 415))
    async def tokenize(request: Request) -> dict:
        """vLLM's /tokenize: {"prompt": text} or {"messages": [...]} (through the chat template) -> the token ids."""
        req = await read_request(request, TokenizeRequest, max_body_bytes, svc.body_timeout)
        if req.messages is not None:
            try:  # the template's own checks (no messages) are the client's mistake
                ids = await asyncio.to_thread(tok.encode_chat, [{"role": m.template_role(), "content": m.text()}
                                                                for m in req.messages])
            except (ValueError, TypeError) as e:
                raise ApiError(400, str(e), param="messages") from None
        elif req.prompt is not None:
            ids = await asyncio.to_thread(tok.encode, req.prompt)
        else:
            raise ApiError(400, "give a 'prompt' (text) or 'messages' (a chat) to tokenize", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.max_model_len}

    @app.get("/metrics", response_class=PlainTextResponse, responses=responses())
    async def metrics() -> PlainTextResponse:
        """Prometheus text: what a dashboard polls (counters since start, gauges now, histograms)."""
        return PlainTextResponse(svc.metrics.render(llm), media_type="text/plain; version=0.0.4")

    @app.get("/health", responses={200: {"model": Health}, **responses(),
                                   503: {"model": Health, "description": WHY[503]}})
    async def health() -> JSONResponse:
        ok = not svc.closing and svc.engine.error is None and svc.engine.is_alive()
        cache = llm.prefix_cache_stats  # None without prefix caching
        return JSONResponse({"status": "ok" if ok else "unavailable", "in_flight": len(svc.engine.in_flight),
                             "waiting": len(llm.scheduler.waiting), "free_blocks": llm.num_free_blocks(),
                             "num_blocks": llm.block_manager.num_blocks,
                             "prefix_cache": cache.as_dict() if cache is not None else None},
                            status_code=200 if ok else 503)

    add_router_endpoints(app)  # /server_info, /model_info, /get_load: a worker of sglang-router
    install_schema(app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest,
                         "/tokenize": TokenizeRequest})  # /openapi.json: the bodies read_request validates
    return app


class Server(uvicorn.Server):
    """uvicorn with a draining shutdown (Service.drain before uvicorn closes connections), a ready line, and the
    connection limits (connections.py: uvicorn's options, the header deadline it lacks, and the app's body
    deadline)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 8000, drain_timeout: float = 30.0,
                 log_level: str = "info", announce: bool = False, limits: ConnectionLimits | None = None):
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                        timeout_graceful_shutdown=drain_timeout + 10,
                                        **(limits := limits or ConnectionLimits()).uvicorn_options()))
        self.app, self.drain_timeout, self.announce = app, drain_timeout, announce
        app.state.service.body_timeout = limits.body_timeout

    @property
    def url(self) -> str:
        host, port = self.servers[0].sockets[0].getsockname()[:2]  # the real port, also when asked for port 0
        return f"http://{host}:{port}"

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        # what is alive now (model, tokenizer, imports: 200,000 objects for SmolLM2) stays alive; frozen, it leaves
        # every later full garbage collection, which stops every thread, this event loop too (120 ms to scan it)
        gc.collect()
        gc.freeze()
        if self.started and self.announce:
            print(f"minillm serve: ready at {self.url}/v1", flush=True)

    async def shutdown(self, sockets=None) -> None:
        await self.app.state.service.drain(self.drain_timeout)
        await super().shutdown(sockets)
        gc.unfreeze()  # a process that goes on (tests, notebooks) collects its garbage again


def serve(llm, model_name: str = "smollm2-135m", host: str = "127.0.0.1", port: int = 8000, max_waiting: int = 64,
          drain_timeout: float = 30.0, log_level: str = "info", access: AccessPolicy | None = None,
          limits: ConnectionLimits | None = None) -> None:
    """Serve `llm` over HTTP until interrupted (Ctrl-C / SIGTERM drain it, see Server)."""
    Server(build_app(llm, model_name, max_waiting, access=access), host, port, drain_timeout, log_level,
           announce=True, limits=limits).run()
