"""The OpenAPI document is the API (lesson 12): request bodies from the very models `read_request` validates with,
response models for every answer, and each status an endpoint can send, so a schema-driven client or fuzzer
(schemathesis) sees what the server does. The endpoints read the raw request (body limits, deadlines, OpenAI-shaped
errors: openai_protocol.py), so FastAPI cannot see their bodies: `install` writes them into the document.
"""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field the server sends but the document lacks fails validation


class ErrorDetail(_Answer):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Answer):
    """OpenAI's error shape, for every status >= 400."""

    error: ErrorDetail


class Usage(_Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Answer):
    """The legacy shape: per token its string, log-probability, alternatives (with itself) and character offset."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TokenLogprob(_Answer):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob]


class ChatLogprobs(_Answer):
    content: list[ChatTokenLogprob]


FinishReason = Literal["stop", "length"] | None  # an aborted request is an error status, not a finish reason


class CompletionChoice(_Answer):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class Completion(_Answer):
    """POST /v1/completions without `stream` (with it: text/event-stream chunks of this shape, then [DONE])."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(_Answer):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Answer):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(_Answer):
    """POST /v1/chat/completions without `stream` (with it: chat.completion.chunk events, then [DONE])."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(_Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Answer):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Answer):
    tokens: list[int]
    count: int
    max_model_len: int


class Health(_Answer):
    status: Literal["ok", "unavailable"]
    in_flight: int
    waiting: int
    free_blocks: int
    num_blocks: int
    prefix_cache: dict[str, float | int] | None


# Why each status is sent; an endpoint lists those it can send (`responses`)
WHY = {
    400: "invalid request: a field's type or range, an empty prompt, a prompt with no room left in the context, "
         "a refused feature (tools, logit_bias, ...); `param` names the field",
    401: "with --api-key: /v1/* needs 'Authorization: Bearer <key>'",
    403: "a Host name or web Origin this server does not answer to (--allowed-hosts, --allowed-origins)",
    404: "the model named in the request is not the one served",
    408: "the body did not arrive within --body-timeout seconds",
    413: "the body is over the size limit",
    415: "the body was not sent as Content-Type: application/json",
    429: "--max-waiting requests are already waiting: retry later",
    500: "the engine failed; every request in flight ends with this",
    503: "the server is shutting down (or, from /health, cannot serve)",
}


def responses(*statuses: int) -> dict:
    """FastAPI `responses=` for these error statuses; 403 applies to every path (the access guard)."""
    return {s: {"model": ErrorResponse, "description": WHY[s]} for s in sorted({403, *statuses})}


GENERATE = (400, 401, 404, 408, 413, 415, 429, 500, 503)
# With `stream: true`: one schema per event (OpenAPI 3.1 reads an event stream's `schema` as each event's), its data
# a chunk of the answer as JSON (choices[].delta for chat, choices[].text for completions), an error, or [DONE]
SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"], "properties": {
        "data": {"type": "string", "description": "a JSON chunk, an {\"error\": ...} object, or [DONE] (the last)"},
        "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}}}


DESCRIPTION = ("minillm serve: OpenAI's completions and chat completions over minillm's engine (lesson 12). Every "
               "error is OpenAI's {\"error\": {message, type, param, code}} with the status that says why.")


def install(app: FastAPI, requests: dict[str, type[BaseModel]]) -> None:
    """Make app.openapi() declare `requests` ({path: model}) as the JSON bodies of those POST routes, from the
    models' own JSON schema: what is documented is what is validated."""

    def document() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes, description=DESCRIPTION)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for path, model in requests.items():
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
                doc["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = document
