"""What one session may take of the worker it shares with every other trajectory: connections on
its socket, and bytes of request bodies (``shared.settings.AgentProxySettings``).

Invariants:
- ``SessionSite``: a session's socket holds at most ``limit`` connections at once; one more is
  closed as soon as it is accepted, so its descriptor is the worker's only for that moment.
  ``abort`` closes the ones still open (the session ended).
- ``read_body``: a body whose declared length passes ``max_body_bytes`` is refused (413) before a
  byte of it is read; a chunked one is read only until its bytes pass the limit. Every byte read
  counts against the session's ``BytesInFlight`` until the caller releases it (once the call is
  answered); a body that would pass ``session_bytes_in_flight`` is refused (429), before it is
  read when its length is declared. A pause over ``idle_timeout_s`` while reading drops it (408).
  A refused body's connection is closed: the rest of it is never read.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import cast

from aiohttp import web

from shared.settings import AgentProxySettings


class BodyRefused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class BytesInFlight:
    limit: int
    held: int = 0

    def check(self, size: int) -> None:
        if self.held + size > self.limit:
            raise BodyRefused(429, f"this session already holds {self.held} bytes of request bodies; "
                                   f"{size} more would pass its {self.limit} (send calls one at a time)")

    def take(self, size: int) -> None:
        self.check(size)
        self.held += size

    def release(self, size: int) -> None:
        self.held -= size


async def read_body(request: web.Request, in_flight: BytesInFlight, limits: AgentProxySettings) -> bytearray:
    """The body, its bytes taken from ``in_flight`` (the caller releases ``len(body)``)."""
    declared = request.content_length
    if declared is not None and declared > limits.max_body_bytes:
        raise BodyRefused(413, f"the body's {declared} bytes pass the proxy's limit of {limits.max_body_bytes}")
    if declared is not None:
        in_flight.check(declared)
    body = bytearray()
    try:
        while chunk := await _next_chunk(request, limits.idle_timeout_s):
            if len(body) + len(chunk) > limits.max_body_bytes:
                raise BodyRefused(413, f"the body passes the proxy's limit of {limits.max_body_bytes} bytes")
            in_flight.take(len(chunk))
            body += chunk
    except BaseException:
        in_flight.release(len(body))
        raise
    return body


async def _next_chunk(request: web.Request, idle_timeout_s: float) -> bytes:
    try:
        return await asyncio.wait_for(request.content.readany(), idle_timeout_s)
    except asyncio.TimeoutError:
        raise BodyRefused(408, f"the body stalled for {idle_timeout_s:g} s") from None


def refusal(exc: BodyRefused) -> web.Response:
    response = web.json_response({"error": {"message": str(exc), "type": "invalid_request_error", "code": None}},
                                 status=exc.status)
    response.force_close()  # what is left of the body is never read
    return response


class _Refused(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cast(asyncio.Transport, transport).abort()  # a stream server's connections have Transports


class _Counted(asyncio.Protocol):
    """The aiohttp handler of one connection, counted by its site while it lives."""

    def __init__(self, inner: asyncio.Protocol, site: SessionSite):
        self.inner, self.site = inner, site
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream server's connections have Transports
        self.site.open.add(self)
        self.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.site.open.discard(self)
        self.site.live -= 1
        self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class SessionSite(web.UnixSite):
    def __init__(self, runner: web.BaseRunner, path: str, limit: int):
        super().__init__(runner, path)
        self.limit, self.live = limit, 0  # live: accepted and not yet lost
        self.open: set[_Counted] = set()

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site; the server is ours, not UnixSite's
        self._server = await asyncio.get_running_loop().create_unix_server(self._protocol, self._path)

    def _protocol(self) -> asyncio.Protocol:
        if self.live >= self.limit:
            return _Refused()
        server = self._runner.server
        if server is None:
            raise RuntimeError("SessionSite accepts connections only while its runner is set up")
        self.live += 1
        return _Counted(server(), self)

    def abort(self) -> None:
        for connection in list(self.open):
            if connection.transport is not None:
                connection.transport.abort()
