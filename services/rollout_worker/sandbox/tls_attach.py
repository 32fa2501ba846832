"""Attaching to a sandbox's PID 1 on a daemon reached over TLS, asyncio-native.

The SDK's attached socket on a TLS connection is an ``ssl.SSLSocket``, which asyncio cannot
adopt; so the attach is made here instead: asyncio's own TLS connection to the daemon, with the
client's certificate and the daemon's CA (those the SDK client was configured with), one
``POST /containers/<id>/attach`` upgraded to a raw stream, and the stream handed to
``session.ShellSession`` as it is. Made before the container starts, like the plain attach, so no
output of the shell is missed.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from urllib.parse import urlsplit

from docker import APIClient

from .errors import SandboxInfraError

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]
MAX_HEAD_BYTES = 16 << 10


@functools.lru_cache(maxsize=16)
def _context(ca_cert: str | None, client_cert: tuple[str, str] | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca_cert)
    if client_cert is not None:
        context.load_cert_chain(*client_cert)
    return context


async def attach(api: APIClient, container_id: str) -> Streams:
    """PID 1's stdin/stdout/stderr as one raw (multiplexed) stream, on a fresh TLS connection."""
    url = urlsplit(str(api.base_url))
    ca = api.verify if isinstance(api.verify, str) else None
    cert = tuple(api.cert) if isinstance(api.cert, (tuple, list)) else None
    reader, writer = await asyncio.open_connection(url.hostname, url.port, ssl=_context(ca, cert),
                                                   server_hostname=url.hostname)
    try:
        writer.write((f"POST /v{api.api_version}/containers/{container_id}/attach?stdin=1&stdout=1&stderr=1&stream=1 "
                      f"HTTP/1.1\r\nHost: {url.hostname}\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n"
                      "Content-Length: 0\r\n\r\n").encode())
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        if len(head) > MAX_HEAD_BYTES or head.split(b" ", 2)[1:2] not in ([b"101"], [b"200"]):
            raise SandboxInfraError(f"attach refused: {head[:200]!r}", reason="daemon_error")
        return reader, writer
    except BaseException:
        writer.close()
        raise
