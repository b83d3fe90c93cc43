"""The OpenAI wire format minillm's server speaks: strict request models, the response and chunk objects, and
OpenAI-style errors (`ApiError`); lesson 12.

Types are validated strictly (no "5" for 5) and values against OpenAI's ranges, a 400 naming the field. Unknown
top-level fields are ignored with a log line (vLLM's behaviour), but those that would change what an answer is
(`logit_bias`, `tools`, ...) are refused: ignoring them would be silently wrong (`REFUSED_FIELDS`). The fields
honoured: `_Common`. See server.py for the endpoints.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect

from minillm.sampling import MAX_TOP_LOGPROBS, SamplingParams
from minillm.serving.stop_strings import MAX_STOP_CHARS, StopMatcher  # noqa: F401  (StopMatcher: re-exported)

logger = logging.getLogger("minillm.serving.openai_protocol")


class ApiError(Exception):
    """An error the client gets as OpenAI's {"error": {message, type, param, code}} with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers  # of the response: {"connection": "close"} when the rest of the request is unread

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def from_validation_error(e: ValidationError) -> ApiError:
    """The first problem pydantic found, said the way a client can act on it, with the field as `param`."""
    err = e.errors()[0]
    # a union member's name ("str", "list[int]") trails the location: keep the field path only
    loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in ("str", "int")))]
    param = ".".join(loc) or None
    if err["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {err['msg']}")
    if err["type"] == "extra_forbidden":
        return ApiError(400, f"unknown field {param!r}: this server does not support it", param=param)
    if err["type"] == "missing":
        return ApiError(400, f"{param!r} is required", param=param)
    return ApiError(400, f"{param or 'body'}: {err['msg']}" + (f", got {err['input']!r}" if loc else ""),
                    param=param)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


# The log-probabilities one request may ask for (n x max_tokens x (top_logprobs + 1)): each is built on the event
# loop, and a plain answer holds them all until it is sent (chat's shape: ~85 bytes of JSON each, 45 MB at the limit)
MAX_LOGPROBS = 1 << 19

# Top-level fields this server does not know are ignored with a log line, as vLLM does (clients send new ones every
# release); these would change what the answer *is*, so ignoring them would be silently wrong: refused
REFUSED_FIELDS = {
    "tools": "tool calling", "tool_choice": "tool calling", "functions": "function calling",
    "function_call": "function calling", "response_format": "structured output (JSON mode / schemas)",
    "best_of": "best-of-n selection", "logit_bias": "logit bias", "suffix": "insertion (suffix)", "echo": "echo",
}


class _Common(_Strict):
    """The sampling fields completions and chat share.

    Honoured: temperature, top_p, n, seed, stop, max_tokens, presence/frequency penalties, logprobs (completions: an
    int, the legacy shape; chat: a bool and top_logprobs, per-token content), stream and stream_options; and vLLM's
    extras (the openai client's `extra_body`): top_k, min_tokens, repetition_penalty and ignore_eos (exactly
    max_tokens tokens, for benchmarks).
    """

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None  # None: the served model
    temperature: float = Field(1.0, ge=0, le=2)  # OpenAI's default; 0 = greedy
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)  # choices, each a sequence sharing the prompt (OpenAI's limit)
    seed: int | None = Field(None, ge=0, lt=2**64)  # choice i is seeded with seed + i
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None  # OpenAI takes up to 4
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    user: str | None = None  # an end-user tag; nothing to do with sampling
    # vLLM's extra parameters
    top_k: int | None = None  # None, 0 or -1: off
    min_tokens: int = Field(0, ge=0)  # stop tokens and stop strings count only after this many tokens
    repetition_penalty: float = Field(1.0, gt=0)  # 1: off
    ignore_eos: bool = False

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise ApiError(400, "stop strings must be non-empty", param="stop")
        if (longest := max(map(len, stops), default=0)) > MAX_STOP_CHARS:
            raise ApiError(400, f"a stop string may be at most {MAX_STOP_CHARS} characters, got one of {longest}: "
                                f"stop on a shorter marker (its first characters)", param="stop")
        return stops


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # legacy: how many alternatives per token


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None  # a participant's name: clients send it; the model's chat template has no place for it

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def template_role(self) -> str:
        """The role in the model's chat template: OpenAI's "developer" (its newer name for instructions) is a system
        turn."""
        return "system" if self.role == "developer" else self.role


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: as many as the context and the KV pool leave
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a text prompt or a chat."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


# ------------------------------------------------------------------------------------------------- requests in


async def _read_body(request, max_bytes: int) -> bytearray:
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            raise ApiError(413, f"the body is over the limit of {max_bytes} bytes")
    return body


async def read_request(request, model: type[_Strict], max_bytes: int, timeout: float | None = None):
    """The body of a starlette Request as `model`: declared application/json (415: a browser posts text/plain to
    another site without asking, see access.py), at most max_bytes (413, counted as it arrives: a client may send
    no Content-Length), all of it within `timeout` seconds (408: a client trickling its body holds a connection and
    a task, see connections.py), UTF-8, JSON, valid (400 naming the field)."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, f"the body must be sent as Content-Type: application/json, got {media or 'none'!r}",
                       code="unsupported_media_type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"the body has {declared} bytes; the limit is {max_bytes}")
    try:
        body = await asyncio.wait_for(_read_body(request, max_bytes), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s (minillm serve --body-timeout)",
                       code="body_timeout", headers={"connection": "close"}) from None
    except ClientDisconnect:  # nobody will read the answer; an error, not a traceback in the log
        raise ApiError(400, "the client left before its request body arrived") from None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the body is not UTF-8 text: {e}") from None
    try:
        req = model.model_validate_json(text)
    except ValidationError as e:
        raise from_validation_error(e) from None
    unknown = list(req.model_extra or {})
    for name in unknown:
        # refused only when it may ask for the feature: a router or SDK that sends "echo": false, "best_of": 1 or a
        # null asks for nothing this server does not do (sglang-router adds "echo": false to every completion)
        value = req.model_extra[name]
        if name in REFUSED_FIELDS and value is not None and value is not False and not (name == "best_of" and
                                                                                         value == 1):
            raise ApiError(400, f"{name!r}: {REFUSED_FIELDS[name]} is not supported by this server", param=name)
    if unknown:  # one line, whatever their number (a line each: 100,000 of them for one 1 MiB body)
        logger.info("ignoring %d field(s) this server does not know (as vLLM does): %s", len(unknown),
                    ", ".join(map(repr, unknown[:5])) + (", ..." if len(unknown) > 5 else ""))
    return req


def sampling_params(req: _Common, served: str, max_tokens: int | None, n_prompt: int, max_model_len: int,
                    pool_tokens: int) -> SamplingParams:
    """OpenAI's fields -> SamplingParams (n choices: SamplingParams.n, the engine seeds choice i with seed + i).
    max_tokens None: as many as the context window and the KV pool leave room for."""
    if req.model is not None and req.model != served:
        raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {served!r}", param="model",
                       code="model_not_found")
    if isinstance(req, ChatRequest):  # chat: a bool and how many alternatives; completions: the number itself
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs, top = bool(req.logprobs), req.top_logprobs or 0
    else:
        logprobs, top = req.logprobs is not None, req.logprobs or 0
    room = min(max_model_len - n_prompt, pool_tokens - n_prompt + 1)  # the engine's own limits (LLM._prepare)
    if room < 1:  # the prompt alone does not fit: say that, whatever max_tokens asks for
        field = "messages" if hasattr(req, "messages") else "prompt"
        raise ApiError(400, f"this prompt has {n_prompt} tokens, leaving no room to generate in the model's context "
                       f"window of {max_model_len} tokens (KV pool {pool_tokens} tokens): shorten it", param=field,
                       code="context_length_exceeded")
    if max_tokens is not None and not 1 <= max_tokens <= room:
        raise ApiError(400, f"max_tokens must be in [1, {room}] for this prompt of {n_prompt} tokens (context "
                       f"window {max_model_len}, KV pool {pool_tokens} tokens), got {max_tokens}",
                       param="max_tokens", code="context_length_exceeded")
    max_tokens = room if max_tokens is None else max_tokens
    if req.min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens ({req.min_tokens}) must be <= max_tokens ({max_tokens})", param="min_tokens")
    if logprobs and (count := req.n * max_tokens * (top + 1)) > MAX_LOGPROBS:
        raise ApiError(400, f"n x max_tokens x (top_logprobs + 1) = {req.n} x {max_tokens} x {top + 1} = {count} "
                       f"log-probabilities, over this server's limit of {MAX_LOGPROBS} per request: ask for fewer "
                       f"choices, alternatives or tokens (max_tokens)", param="logprobs")
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                              top_k=None if req.top_k in (None, 0, -1) else req.top_k, ignore_eos=req.ignore_eos,
                              logprobs=logprobs, top_logprobs=top, presence_penalty=req.presence_penalty,
                              frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                              min_tokens=req.min_tokens, n=req.n)
    except ValueError as e:  # SamplingParams' messages start with the field's name
        name = str(e).split()[0]
        raise ApiError(400, str(e), param=name if name in type(req).model_fields else None) from None


# ---------------------------------------------------------------------------------------------------- responses


class LogprobsWriter:
    """One choice's token log-probabilities in OpenAI's shape, written as the tokens arrive (a stream writes each
    chunk's own). Chat: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}. Completions
    (the legacy shape): {tokens, token_logprobs, top_logprobs: [{token: logprob}] (the alternatives and the chosen
    token, as OpenAI's), text_offset} where text_offset counts characters of the tokens' strings from the start of
    the completion. A token's string is its bytes decoded (U+FFFD for a part of a character: `bytes` has them)."""

    def __init__(self, tokenizer, chat: bool):
        self.tok, self.chat, self.offset = tokenizer, chat, 0

    def _text(self, token_id: int) -> tuple[str, list[int]]:
        raw = self.tok.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def write(self, tokens: list[tuple[int, float, list[tuple[int, float]] | None]]) -> dict:
        """tokens: (id, logprob, [(id, logprob)] alternatives or None), the engine's StreamEvent fields."""
        if self.chat:
            def entry(token_id: int, logprob: float) -> dict:
                text, raw = self._text(token_id)
                return {"token": text, "logprob": logprob, "bytes": raw}
            return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top or []]}
                                for t, lp, top in tokens]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp, top in tokens:
            text = self._text(t)[0]
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({self._text(a)[0]: alp for a, alp in [*(top or []), (t, lp)]})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def extend_logprobs(total: dict, part: dict) -> None:
    """Append LogprobsWriter.write's `part` to `total` (one choice's logprobs so far, from write([]))."""
    for key, values in part.items():
        total[key].extend(values)


_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))  # as JSONResponse writes


def json_pieces(obj, depth: int = 0, run: int = 64):
    """`obj` as JSONResponse would write it, in pieces of bounded size: dicts (string keys) and lists are opened down
    to a choice's logprobs lists (depth 4), which are encoded `run` entries (tokens) at a time."""
    if depth < 4 and isinstance(obj, dict):
        yield "{"
        for i, (key, value) in enumerate(obj.items()):
            yield ("," if i else "") + _JSON.encode(key) + ":"
            yield from json_pieces(value, depth + 1, run)
        yield "}"
    elif depth < 4 and isinstance(obj, list):
        yield "["
        for i, value in enumerate(obj):
            if i:
                yield ","
            yield from json_pieces(value, depth + 1, run)
        yield "]"
    elif isinstance(obj, list):
        yield "["
        for i in range(0, len(obj), run):
            yield ("," if i else "") + _JSON.encode(obj[i:i + run])[1:-1]
        yield "]"
    else:
        yield _JSON.encode(obj)


async def encode_json(obj, slice_s: float = 0.005) -> bytes:
    """json_pieces encoded, letting the event loop run other requests every `slice_s` seconds: one json.dumps of a
    large plain answer (n choices of logprobs) holds the loop, and the GIL, for as long as it takes (0.2-0.3 s for
    64 choices of 390 tokens with 20 alternatives each, the most MAX_LOGPROBS allows)."""
    out, t0 = [], time.perf_counter()
    for piece in json_pieces(obj):
        out.append(piece.encode())
        if time.perf_counter() - t0 > slice_s:
            await asyncio.sleep(0)
            t0 = time.perf_counter()
    return b"".join(out)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """The prompt counts once, whatever n; completion tokens are summed over the choices."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(chat: bool, index: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
    """One choice of a whole (not streamed) answer."""
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def body(rid: str, model: str, chat: bool, choices: list[dict], usage_: dict) -> dict:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage_}


def chunk(rid: str, model: str, chat: bool, text: str | None, finish: str | None, usage_: dict | None = None,
          role: bool = False, with_usage: bool = False, index: int = 0, logprobs: dict | None = None) -> dict:
    """One SSE chunk: choice `index`'s new text and the logprobs of the tokens it carries. text None: no choice
    (the usage chunk). with_usage: stream_options.include_usage, where every chunk carries "usage" (null but in the
    last one), as OpenAI's stream does."""
    if text is None:
        choices = []
    elif chat:
        delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
        choices = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
    else:
        choices = [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]
    out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
           "model": model, "choices": choices}
    if with_usage:
        out["usage"] = usage_
    return out
