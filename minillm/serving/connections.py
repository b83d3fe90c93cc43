"""How many connections the server holds, and for how long (lesson 12): a client that opens sockets and sends its
headers a byte at a time (slowloris) must not keep them forever, nor a crowd of clients take every socket.

uvicorn has options for most of it (`ConnectionLimits.uvicorn_options`); it has no deadline for a request's headers
(an idle new connection, or a request line trickling in, is held forever), so `limited_protocol` adds that timer
to uvicorn's own HTTP protocol, and a hard cap on open sockets. The body's deadline is read_request's (a 408).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

logger = logging.getLogger("minillm.serving.connections")

# a request line + headers larger than this get a 400: h11's default, said here (uvicorn's httptools protocol, used
# when httptools is installed, does not take this option)
MAX_HEADER_BYTES = 16 * 1024


@dataclass(frozen=True)
class ConnectionLimits:
    """What `minillm serve` allows a connection (its --max-connections, --header-timeout, --body-timeout and
    --keep-alive-timeout flags)."""

    max_connections: int = 256  # open at once; a request on one more gets 503, and past twice this, none is kept
    header_timeout: float = 10.0  # seconds for a request's line and headers (from the connection's opening, or
    # on a kept-alive one from the next request's first byte)
    body_timeout: float = 30.0  # seconds for its body (read_request: 408)
    keep_alive_timeout: float = 5.0  # seconds an idle connection stays open between two requests

    def __post_init__(self):
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")

    def uvicorn_options(self) -> dict:
        """uvicorn.Config's options for these limits, and the protocol that adds what uvicorn lacks."""
        return {
            # uvicorn answers 503 to a request when open connections (the asking one included) reach this
            "limit_concurrency": self.max_connections + 1,
            "timeout_keep_alive": self.keep_alive_timeout,  # uvicorn's timer, armed once a response is sent
            "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
            "backlog": 2 * self.max_connections,  # connections the kernel queues before we accept them
            "http": limited_protocol(self),  # the header deadline and the hard cap: not uvicorn options
        }

    def describe(self) -> str:
        return (f"connections: {self.max_connections} at once (503 past that), headers within "
                f"{self.header_timeout:g} s, bodies within {self.body_timeout:g} s, idle keep-alive "
                f"{self.keep_alive_timeout:g} s")


def limited_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools' when installed, else h11's) with a deadline for each request's line and
    headers and a cap of 2 x max_connections open sockets."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class LimitedHTTPProtocol(AutoHTTPProtocol):
        header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            # uvicorn's 503 past max_connections needs the request's headers first; the sockets waiting for them
            # cost a file descriptor each, so past twice the limit a new one is closed unread
            if len(self.connections) > 2 * limits.max_connections:
                logger.warning("%d connections open: closing a new one unread", len(self.connections) - 1)
                transport.close()
                return
            self._start_header_timer()

        def data_received(self, data: bytes) -> None:
            if self.header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._start_header_timer()  # the first bytes of the next request on a kept-alive connection
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:  # uvicorn made a new request cycle: its headers are complete
                self._stop_header_timer()

        def connection_lost(self, exc) -> None:
            self._stop_header_timer()
            super().connection_lost(exc)

        def _start_header_timer(self) -> None:
            self.header_timer = self.loop.call_later(limits.header_timeout, self._headers_timed_out)

        def _stop_header_timer(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _headers_timed_out(self) -> None:
            self.header_timer = None
            if not self.transport.is_closing():
                logger.debug("closing a connection whose request headers took over %g s", limits.header_timeout)
                self.transport.close()

    return LimitedHTTPProtocol
