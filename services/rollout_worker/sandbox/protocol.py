"""The line protocol spoken to the sandbox's shell, and the parser of its answers. Pure: no I/O.

The container's PID 1 is a non-interactive POSIX shell (ash or dash) whose stdin is our attached
socket and whose stdout carries the answers. For each command we send one line:

    ( cd CWD; eval CMD; r=$?; __cv_say <nonce> "D$PWD"; exit $r ) </dev/null 2>&1 &
    wait $!; ...; __cv_say <nonce> "R$rc"

(``__cv_say``, defined by ``PREAMBLE``, prints ``<nonce> <text>`` and retries on failure.)

- The command runs in a background subshell, so ``exit``, ``exec``, traps or an endless builtin
  loop cannot take the session shell down, and the shell sits in ``wait``, which a trapped signal
  interrupts. The session installs ``trap 'kill -9 -1' USR1``: a SIGUSR1 sent by the daemon to
  PID 1 kills every other process of the sandbox without forking (so it works under a fork bomb).
- ``D`` reports the final working directory (a command's ``cd`` persists: the next line starts
  there; shell variables do not persist). ``R`` carries the exit status and ends the command.
- The nonce is fresh per command and is never in a variable or an argv the command can read, so
  a command cannot forge a trailer (it could only end its own command early).
- A non-interactive shell exits when it cannot fork (every pid held by the agent's processes).
  Its EXIT trap then execs a fresh shell in place (no fork needed) after printing
  ``RESTART_MARKER``; the command ends without an exit status and the session re-installs the
  traps, kills everything and resynchronises before the next command.
- Why not ``sh -i``, which survives fork failures: interactive ash reads stdin through stdio, and
  a signal arriving while it reads (a SIGCHLD storm, our USR1) looks like EOF, so it exits.
"""

from __future__ import annotations

import re
import secrets
import shlex
import struct

# PID 1 (`exec` keeps the pid), reading commands from stdin. Its own stderr (job notices such as
# "Killed", which ash may print one command late) is discarded; commands get 2>&1 in their subshell.
SESSION_COMMAND = ["sh", "-c", "exec sh 2>/dev/null"]
SESSION_ENV = {"ENV": ""}
RESTART_MARKER = b"<conveyor: session shell restarted>"
# __cv_say NONCE TEXT prints one trailer line, retrying: a write to a full stdout pipe fails with
# EINTR when a SIGCHLD arrives (ash installs its handler without SA_RESTART), and the trailer
# would be lost. USR1 kills every other process. EXIT (the shell failed to fork a command and gives
# up) replaces PID 1 by a fresh shell on the same stdin: exec needs no fork, so the sandbox
# survives pid exhaustion; the session sees the marker, re-sends this preamble and resynchronises.
PREAMBLE = (
    "__cv_say() { __cv_i=0; until printf '%s %s\\n' \"$1\" \"$2\"; do "
    "__cv_i=$((__cv_i+1)); [ $__cv_i -lt 1000 ] || return 1; done; }; "
    "trap 'kill -9 -1' USR1; "
    f"trap '__cv_say \"{RESTART_MARKER.decode()}\" \"\"; exec sh' EXIT\n"
)
KILL_SIGNAL = "SIGUSR1"

_HEADER = struct.Struct(">BxxxL")  # docker's multiplexed stream frame header (tty=False)
HEADER_SIZE = _HEADER.size


def frame_length(header: bytes) -> int:
    return _HEADER.unpack(header)[1]


def new_nonce() -> str:
    return secrets.token_hex(8)


def sync_line(nonce: str) -> bytes:
    """A no-op command whose answer marks a point in the stream (used to resynchronise)."""
    return f"__cv_say {nonce} R0\n".encode()


def command_lines(command: str, nonce: str, cwd: str) -> bytes:
    body = (
        f"( cd {shlex.quote(cwd)} 2>/dev/null; eval {shlex.quote(command)}; __cv_r=$?; "
        f"__cv_say {nonce} \"D$PWD\"; exit $__cv_r ) </dev/null 2>&1 & "
        # A trapped USR1 interrupts `wait` (status > 128) while the killed job may still be a zombie.
        "wait $!; __cv_r=$?; "
        "while [ $__cv_r -gt 128 ] && kill -0 $! 2>/dev/null; do wait $!; __cv_r=$?; done; "
        f"__cv_say {nonce} R$__cv_r\n"
    )
    return body.encode()


class CommandStream:
    """Collects one command's bytes until its ``R`` trailer; keeps at most ``max_output`` bytes.

    Trailers start with ``<nonce> `` and end at a newline (``D``, ``R``). Every other byte is
    output: the command's, or stray output of its background jobs between trailers. Bytes after
    the ``R`` line belong to the next command (``leftover``).
    """

    def __init__(self, nonce: str, max_output: int):
        self._marker = f"{nonce} ".encode()
        self._max = max_output
        self._buf = bytearray()  # not yet classified: may hold a partial marker or trailer
        self.output = bytearray()
        self.total = 0
        self.exit_code: int | None = None
        self.cwd: str | None = None
        self.done = False
        self.restarted = False  # the shell died and was replaced: this command has no exit status
        self.leftover = b""

    @property
    def truncated(self) -> bool:
        return self.total > len(self.output)

    def feed(self, data: bytes) -> None:
        if self.done:
            self.leftover += data
            return
        buf = self._buf
        buf += data
        marker = self._marker
        restart = buf.find(RESTART_MARKER)
        if restart >= 0:
            self._emit(buf[:restart])
            self.restarted = self.done = True
            self.leftover = bytes(buf[restart + len(RESTART_MARKER) :])
            buf.clear()
            return
        while True:
            at = buf.find(marker)
            if at < 0:
                keep = len(RESTART_MARKER) - 1  # the tail might be the first bytes of a marker
                if len(buf) > keep:
                    self._emit(buf[:-keep])
                    del buf[:-keep]
                return
            if at:
                self._emit(buf[:at])
                del buf[:at]
            newline = buf.find(b"\n", len(marker))
            if newline < 0:
                return  # the rest of this trailer has not arrived yet
            kind = bytes(buf[len(marker) : len(marker) + 1])
            value = bytes(buf[len(marker) + 1 : newline]).decode(errors="replace")
            del buf[: newline + 1]
            if kind == b"D":
                self.cwd = value
            elif kind == b"R":
                self.exit_code = int(value) if value.lstrip("-").isdigit() else None
                self.done = True
                self.leftover = bytes(buf)
                buf.clear()
                return

    @property
    def next_bytes(self) -> bytes:
        """Bytes after the R line that belong to the next command, minus repeated trailers of this
        one (a retried trailer can be written twice)."""
        return re.sub(re.escape(self._marker) + rb"[^\n]*\n", b"", self.leftover)

    def _emit(self, data: bytes | bytearray) -> None:
        self.total += len(data)
        room = self._max - len(self.output)
        if room > 0:
            self.output += data[:room]
