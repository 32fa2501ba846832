"""Copying a workspace (a host directory or a tar archive) into a running sandbox.

The root filesystem is read-only and the workspace is a tmpfs, so ``put_archive`` cannot be
used (the daemon refuses read-only roots and writes beneath tmpfs mounts). Instead the archive
is streamed into ``tar -x`` through one exec's stdin, as the sandbox user. On a daemon reached
over TLS, stdin cannot be half-closed (shutting an ``SSLSocket``'s write side ends its TLS), so
there ``head -c <length>`` ends tar's input instead of EOF. Blocking functions: call them through
``blocking.run_blocking``.
"""

from __future__ import annotations

import io
import socket
import ssl
import tarfile
from pathlib import Path

from docker import APIClient

from .errors import SandboxInfraError

WorkspaceSource = Path | str | bytes


def pack(source: WorkspaceSource) -> bytes:
    """A tar archive of a directory's contents, or ``source`` itself when it already is one."""
    if isinstance(source, bytes):
        return source
    root = Path(source)
    if not root.is_dir():
        raise ValueError(f"workspace source {root} is not a directory")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for path in sorted(root.iterdir()):
            archive.add(path, arcname=path.name)
    return buf.getvalue()


def copy_in(api: APIClient, container_id: str, archive: bytes, *, dest: str, user: str | None) -> None:
    tls = str(api.base_url).startswith("https://")
    argv = (["sh", "-c", 'head -c "$1" | tar -x -f - -C "$2"', "sh", str(len(archive)), dest] if tls
            else ["tar", "-x", "-f", "-", "-C", dest])
    exec_id = api.exec_create(container_id, argv, stdin=True, user=user or "")["Id"]
    attached = api.exec_start(exec_id, socket=True)
    sock: socket.socket = getattr(attached, "_sock", attached)
    try:
        sock.sendall(archive)
        if not tls:
            sock.shutdown(socket.SHUT_WR)  # EOF on tar's stdin
        output = bytearray()
        while chunk := _recv(sock):
            if len(output) < 4096:
                output += chunk
    finally:
        sock.close()
    exit_code = api.exec_inspect(exec_id)["ExitCode"]
    if exit_code != 0:
        raise SandboxInfraError(f"copying the workspace in failed (tar exit {exit_code}): "
                                f"{bytes(output[8:]).decode(errors='replace')[:500]}", reason="workspace_copy")


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except ssl.SSLEOFError:  # the daemon closed the TLS connection without close_notify: the end
        return b""
