"""Runs inside a sandbox: a TCP listener on the container's loopback that forwards each
connection to the trajectory's proxy socket. Standard library only (the sandbox's python3).

    python3 forward.py PORT SOCKET_PATH

Invariant: it listens on 127.0.0.1 only and connects nowhere but ``SOCKET_PATH``; the sandbox
has no other network, so the proxy session behind that socket is all an agent can reach.
It prints ``ready`` once listening.
"""

import asyncio
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def _serve(port: int, socket_path: str) -> None:
    async def forward(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            proxy_reader, proxy_writer = await asyncio.open_unix_connection(socket_path)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(_pipe(client_reader, proxy_writer), _pipe(proxy_reader, client_writer))

    server = await asyncio.start_server(forward, "127.0.0.1", port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_serve(int(sys.argv[1]), sys.argv[2]))
