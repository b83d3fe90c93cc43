"""Who may call the server (lesson 12): a server on 127.0.0.1 is still reachable from every web page its user opens.

A browser sends a cross-origin POST with `Content-Type: text/plain` without asking first (no CORS preflight), so a
server that parses any body as JSON would generate for any page; with DNS rebinding (a page's own host name made to
resolve to 127.0.0.1) the page can also read the answers, unless the server checks the Host header. So, as vLLM and
llama.cpp's server do, `AccessGuard` checks the Host, the Origin and the API key before a byte of the body is read,
and the body's Content-Type must be application/json (openai_protocol.read_request: 415).
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class AccessPolicy:
    """allowed_hosts: host names (without port) a request may name in its Host header; "*" allows any (behind a
    proxy that checks them). allowed_origins: browser origins (scheme://host[:port]) allowed to call, "*" any."""

    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS
    allowed_origins: tuple[str, ...] = ()

    def host_allowed(self, host_header: str) -> bool:
        name = host_header.strip().lower()
        if name.startswith("["):  # [::1]:8000
            name = name[1:name.find("]")] if "]" in name else name
        elif name.count(":") == 1:  # host:port (a bare IPv6 address has several colons)
            name = name.split(":")[0]
        return "*" in self.allowed_hosts or name in self.allowed_hosts

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin.rstrip("/") in self.allowed_origins

    def key_ok(self, authorization: str | None) -> bool:
        if self.api_key is None:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())


def _error(status: int, message: str, code: str) -> tuple[int, bytes]:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    return status, json.dumps(body).encode()


class AccessGuard:
    """ASGI middleware applying an AccessPolicy to every HTTP request (build_app installs it).

    In this order, before a byte of the body is read:

        Host     the name the client asked for must be an allowed one (loopback names by default)    403
        Origin   a request a browser sent from another site is refused unless that origin is allowed  403
        API key  with api_key set, /v1/* needs `Authorization: Bearer <key>` (constant-time compare)  401

    CORS headers are only sent to the allowed origins, so a page elsewhere cannot read an answer either.
    """

    def __init__(self, app, policy: AccessPolicy):
        self.app, self.policy = app, policy

    def refusal(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, bytes] | None:
        p = self.policy
        host = headers.get("host", "")
        if not p.host_allowed(host):
            return _error(403, f"the Host header {host!r} is not one this server answers to (a page using DNS "
                               f"rebinding sends its own name); start it with --allowed-hosts to add a name",
                          "host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not p.origin_allowed(origin):  # "null" (a sandboxed page) only with "*"
            return _error(403, f"requests from the web origin {origin!r} are refused (a browser page on another "
                               f"site); start the server with --allowed-origins to allow one", "origin_not_allowed")
        if method != "OPTIONS" and path.startswith("/v1/") and not p.key_ok(headers.get("authorization")):
            return _error(401, "a valid API key is required: send the header 'Authorization: Bearer <key>' (the "
                               "openai client's api_key)", "invalid_api_key")
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refused = self.refusal(scope["method"], scope["path"], headers)
        if refused is not None:
            status, body = refused
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            return await send({"type": "http.response.body", "body": body})
        origin = headers.get("origin")
        cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")] if origin else []
        if origin and scope["method"] == "OPTIONS":  # an allowed origin's preflight
            await send({"type": "http.response.start", "status": 204, "headers": cors + [
                (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                (b"access-control-allow-headers", b"authorization, content-type")]})
            return await send({"type": "http.response.body", "body": b""})

        async def send_with_cors(message) -> None:
            if cors and message["type"] == "http.response.start":
                message = {**message, "headers": list(message.get("headers", [])) + cors}
            await send(message)

        await self.app(scope, receive, send_with_cors)
