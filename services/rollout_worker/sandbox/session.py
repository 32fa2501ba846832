"""A persistent shell session on the socket attached to the sandbox's PID 1 (see ``protocol``).

Invariants:
- One command at a time per session (a lock); one reader task owns the socket's read side, so
  cancelling a caller never leaves a half-read frame behind.
- A call returns within ``timeout_s + kill_grace_s`` (plus one daemon call to deliver the kill
  signal) or raises ``SandboxLost``: on the deadline, or when the output passes the flood limit,
  the session signals PID 1, whose trap kills every other process in the sandbox.
- If a caller is cancelled mid-command, or a command was killed, the next call first discards
  everything up to a fresh marker (killing what still runs if the caller was cancelled), so a
  command never sees the output of a command that ended abnormally.
- Kept output is bounded per command; output arriving between commands (background jobs) is
  bounded too and handed to the next command. Every byte received counts towards the flood
  limit, an unfinished trailer line included.
- Commands run as the sandbox user, through the worker when ``open`` could start one (one round
  trip: ``protocol.open_lines``); ``as_root`` is for commands the grader composes itself (never
  the agent's text), see ``protocol``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Awaitable, Callable

from .errors import SandboxLost
from .protocol import (HEADER_SIZE, CommandStream, command_lines, frame_length, new_nonce, open_lines, preamble,
                       restart_marker, sync_line)
from .results import ExecResult

log = logging.getLogger(__name__)

Kill = Callable[[], Awaitable[None]]
SETTLE_S = 0.25  # > one CFS period (100 ms): time for killed processes in a throttled cgroup to die


class ShellSession:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, kill: Kill, cwd: str,
                 kill_grace_s: float, flood_bytes: int, uid: int, gid: int, max_pending_bytes: int = 64 << 10):
        self.cwd = cwd
        self._uid, self._gid = uid, gid
        self._secret = new_nonce()
        self._tool: str | None = None  # how the root shell drops to uid:gid (probed at open)
        self._worker = False  # commands go through the worker shell (protocol.worker_definitions)
        self._restart = restart_marker(self._secret)
        self._reader, self._writer = reader, writer
        self._kill_fn = kill
        self._grace = kill_grace_s
        self._flood = flood_bytes
        self._max_pending = max_pending_bytes
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._current: CommandStream | None = None
        self._pending = bytearray()
        self._eof = False
        self._desynced = False  # bytes of an earlier command may still arrive: drain before the next one
        self._kill_on_sync = False  # ... and something may still run: kill it first
        self._settle = False  # ... and killed processes may still be dying: pause before draining
        self._armed = False  # the shell's traps are installed (a restarted shell has none)
        self._broken: str | None = None
        self._task = asyncio.create_task(self._read_loop(), name="conveyor-shell-reader")

    @classmethod
    async def open(cls, sock: socket.socket | tuple[asyncio.StreamReader, asyncio.StreamWriter], *, kill: Kill, cwd: str, kill_grace_s: float, flood_bytes: int,
                   ready_timeout_s: float, uid: int, gid: int) -> ShellSession:
        """Wrap an attached socket (or the streams of one, ``tls_attach``) whose peer is a fresh root
        ``sh``; returns once the shell answers. Commands run as ``uid:gid``."""
        reader, writer = sock if isinstance(sock, tuple) else await asyncio.open_connection(sock=sock)
        session = cls(reader, writer, kill=kill, cwd=cwd, kill_grace_s=kill_grace_s, flood_bytes=flood_bytes,
                      uid=uid, gid=gid)
        try:
            await session._sync(ready_timeout_s, kill=False, first=True)
        except BaseException:
            await session.close()
            raise
        return session

    async def run(self, command: str, *, timeout_s: float, max_output_bytes: int, as_root: bool = False) -> ExecResult:
        async with self._lock:
            if self._desynced:
                await self._sync(self._grace, kill=self._kill_on_sync)
            self._check_usable()
            loop = asyncio.get_running_loop()
            nonce = new_nonce()
            stream = CommandStream(nonce, max_output_bytes, self._restart)
            start = loop.time()
            self._current, pending, self._pending = stream, bytes(self._pending), bytearray()
            kills, timed_out = 0, False
            try:
                stream.feed(pending)
                self._writer.write(command_lines(command, nonce, self.cwd, as_root=as_root, worker=self._worker))
                deadline = start + timeout_s
                while not stream.done:
                    if self._eof:
                        last_words = bytes(stream.output[-300:]).decode(errors="replace").strip()
                        raise self._lost(f"the sandbox's shell exited; its last output: {last_words!r}")
                    now = loop.time()
                    if kills == 0 and (now >= deadline or stream.received > self._flood):
                        timed_out = now >= deadline
                        await self._kill()
                        kills, deadline = 1, loop.time() + self._grace / 2
                        continue
                    if now >= deadline:
                        if kills == 1:  # signal PID 1 once more before giving the sandbox up
                            await self._kill()
                            kills, deadline = 2, loop.time() + self._grace / 2
                            continue
                        raise self._lost(f"the shell did not answer within {self._grace:.1f}s of killing a command")
                    await self._wait_for_reader(deadline - now)
            except BaseException:
                self._desynced = self._kill_on_sync = True
                raise
            finally:
                self._current = None
            self._pending = bytearray(stream.next_bytes[: self._max_pending])
            if stream.cwd:
                self.cwd = stream.cwd
            if kills:
                # A writer killed while blocked on the full pipe may still push a page after the R
                # trailer, up to a CPU-quota period later: drain past a fresh marker, after a pause.
                self._desynced, self._settle = True, True
            if stream.restarted:
                # The new shell has no traps, and what exhausted the pids still runs: re-arm, kill.
                self._desynced = self._kill_on_sync = True
                self._armed = False
            output = bytes(stream.output)
            return ExecResult(
                exit_code=None if kills or stream.restarted else stream.exit_code,
                output=output.decode("utf-8", errors="replace"),
                truncated=stream.truncated,
                timed_out=timed_out,
                duration_s=loop.time() - start,
                output_bytes=stream.total,
                raw=output,
            )

    async def close(self) -> None:
        self._broken = self._broken or "closed"
        self._task.cancel()
        try:
            self._writer.close()
        except OSError:
            pass
        try:
            await self._task
        except (asyncio.CancelledError, Exception):
            pass

    async def _sync(self, timeout_s: float, *, kill: bool, first: bool = False) -> None:
        """Discard everything up to a fresh marker, (re-)arming the shell's traps on the way.

        With ``kill``, whatever still runs is killed: before the marker when the traps are armed
        (a running command would keep the shell from reading it), after it otherwise.
        """
        self._check_usable()
        if kill and self._armed:
            await self._kill()
            kill, self._settle = False, True
        if self._settle:
            await asyncio.sleep(SETTLE_S)
            self._settle = False
        loop = asyncio.get_running_loop()
        nonce = new_nonce()
        stream = CommandStream(nonce, 0, self._restart)
        self._current, self._pending = stream, bytearray()
        try:
            if first:
                self._writer.write(open_lines(self._uid, self._gid, self._secret, nonce))
            else:
                self._writer.write(preamble(self._secret, self._tool, self._uid, self._gid) + sync_line(nonce))
            deadline = loop.time() + timeout_s
            while not stream.done:
                if self._eof:
                    raise self._lost("the sandbox's shell exited")
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise self._lost(f"the shell did not answer within {timeout_s:.1f}s")
                await self._wait_for_reader(remaining)
        finally:
            self._current = None
        if stream.restarted:  # replaced again while we waited: arm the new shell
            self._armed = False
            return await self._sync(timeout_s, kill=kill, first=first)
        if first:
            tool, _, worker = (stream.cwd or "none").partition(" ")
            self._tool, self._worker = tool, worker == "worker"
        self._pending = bytearray(stream.next_bytes[: self._max_pending])
        self._desynced, self._kill_on_sync, self._armed = False, False, True
        if kill:
            await self._kill()  # the trap runs when the shell reads the next command

    async def _wait_for_reader(self, timeout_s: float) -> None:
        """Sleep until the reader has news (command done, flood, EOF) or ``timeout_s`` passes."""
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout_s)
        except TimeoutError:
            pass

    async def _kill(self) -> None:
        try:
            await self._kill_fn()
        except Exception as exc:  # the container may be gone; the reader will see EOF
            log.warning("killing the sandbox's commands failed: %s", exc)

    async def _read_loop(self) -> None:
        try:
            while True:
                header = await self._reader.readexactly(HEADER_SIZE)
                data = await self._reader.readexactly(frame_length(header))
                stream = self._current
                if stream is None:
                    room = self._max_pending - len(self._pending)
                    if room > 0:
                        self._pending += data[:room]
                    continue
                stream.feed(data)
                if stream.done or stream.received > self._flood:
                    self._wake.set()
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            self._eof = True
            self._wake.set()

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise SandboxLost(f"the shell session is unusable: {self._broken}")
        if self._eof:
            raise self._lost("the sandbox's shell exited")

    def _lost(self, why: str) -> SandboxLost:
        self._broken = self._broken or why
        return SandboxLost(why)
