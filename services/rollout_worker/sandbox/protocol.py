"""The line protocol spoken to the sandbox's shell, and the parser of its answers. Pure: no I/O.

The container's PID 1 is a non-interactive POSIX shell (ash or dash) running as **root** with
only CAP_SETUID, CAP_SETGID and CAP_KILL. Its stdin is our attached socket; its stdout carries
the answers. Commands never run as root. For each command we send one line

    __cv_run <nonce> 'cd -- CWD
    CMD'

``__cv_run`` (``worker_definitions``) writes the script to a file named by a fresh random token
in ``CONTROL_DIR`` (which commands cannot list) and sends the nonce and the token to
``GO_FIFO``. The worker, a shell of the sandbox user (65534 by default, no capabilities, started
once through ``DROP``: util-linux ``setpriv`` or busybox ``su``), runs the script in a forked
subshell, prints ``<nonce> D<cwd>`` and ``<nonce> R<status>`` once ``wait`` returns, and tells
the root shell the status through ``STATUS_FIFO``. Without the FIFOs, or where the sandbox user
cannot execute the worker's shell (gVisor's runsc refuses to execute a file its user cannot
read), there is no worker and the command runs unstarted: ``DROP 'cd "$1"; eval "$2"; ...' sh
CWD CMD &``, one privilege drop (two execs) per command. Then no process of the sandbox user
ever holds a nonce: only the root shell does, and the command is a fresh exec.

Invariants (why a command cannot subvert its session):
- The shell and the commands run under different uids, so a command cannot read or write the
  shell's memory (``/proc/1/mem``), its file descriptors or input (``/proc/1/fd/0``), nor signal
  it (no CAP_KILL after the drop). The worker shares the commands' uid but runs a copy of sh it
  cannot read (``WORKER_SHELL``, 0711), so the kernel makes it non-dumpable: its memory and
  descriptors are closed to them too. They can signal or kill it: the root shell then starts a
  new one (a command it had not started yet runs there; one it had gives status "?").
- The stdio pipes belong to root (the runtime chowns them to PID 1's uid), so a command can
  write its stdout but cannot reopen it to read what the shell writes there. ``CONTROL_DIR`` is
  root's (0711; the FIFOs and the grader's report files are 0600). The seccomp profile
  (``seccomp``) also forbids ptrace, process_vm_* and pidfd_getfd.
- Trailers are written by the root shell or the worker only. The nonce is fresh per command and
  exists only in their memories, in the root-only FIFO between them, and in what they write to
  the (unreadable) stdout. The command's subshell unsets it before the script runs; forked from
  the worker without an exec, it is non-dumpable too, so no process can read what is left of it
  in its memory: a command cannot learn the nonce, so it cannot forge a trailer. ``R``
  carries the status that ``wait`` gave the worker (or the root shell) for the command's process.
- The command's final directory travels through ``CWD_FILE`` via an inherited descriptor; a
  command can only misreport its own cwd, which is quoted when reused.
- ``kill -9 -1`` in the root shell's USR1 trap kills every other process of the sandbox without
  forking, whatever a command did to its own shell or traps.
- A non-interactive shell exits when it cannot fork (every pid held by the agent's processes).
  Its EXIT trap then execs a fresh root shell in place after printing the session's restart
  marker, which carries a per-session secret (so a command cannot print it either). Nothing in
  the preamble forks.
- The parser runs in linear time: it keeps at most one trailer's worth of unclassified bytes,
  and a "trailer" longer than ``MAX_TRAILER`` is output. Every byte received counts (``received``).
Under gVisor (``runtime: runsc``, checked with Debian's 0.0~20221219) the uid wall holds:
``/proc/1/mem`` and ``/proc/1/fd/0`` are refused to other uids, and ``/proc/1/fd/1`` cannot be
reopened, so the root shell keeps the nonce as under runc. What does not hold there: gVisor lets
any process read ``/proc/<pid>/fd/N`` of another process of the same uid (so a worker's FIFO
ends would be open to commands: one more reason there is none), lets other uids read PID 1's
``environ`` and ``maps`` and list its ``fd`` (no secret is in them: the nonce and the restart
secret are unexported shell variables), and the seccomp profile is not applied (gVisor's Sentry
answers those calls; ptrace of another uid's process is still refused by the uid check).
Not covered: processes of the sandbox user can tamper with each other (a background job of one
command with a later command's process), as in any shell; that is the agent acting on itself.
"""

from __future__ import annotations

import re
import secrets
import shlex
import struct

# PID 1 (`exec` keeps the pid), reading commands from stdin. Its own stderr (job notices such as
# "Killed", which ash may print one command late) is discarded; commands get 2>&1.
SESSION_COMMAND = ["sh", "-c", "exec sh 2>/dev/null"]
SESSION_ENV = {"ENV": ""}
SESSION_USER = "0:0"
SESSION_CAPS = ("SETUID", "SETGID", "KILL")  # the root shell's only capabilities
CONTROL_DIR = "/run/conveyor"  # tmpfs owned by root, 0711: commands cannot list it or create files in it
CWD_FILE = f"{CONTROL_DIR}/cwd"
CMD_PREFIX = f"{CONTROL_DIR}/c."  # + a random token: a command's script (readable, not writable, unlisted)
GO_FIFO = f"{CONTROL_DIR}/go"  # root-only FIFOs: root -> worker "go" lines, worker -> root "s" and statuses
STATUS_FIFO = f"{CONTROL_DIR}/status"
AGENT_DIR = "/run/conveyor-agent"  # read-only: the trajectory's agent-proxy socket (SandboxSpec.agent_socket_dir)
AGENT_SOCKET = f"{AGENT_DIR}/proxy.sock"
BIN_DIR = "/run/conveyor-bin"  # tmpfs (exec) owned by root, 0711: the worker's unreadable shell
WORKER_SHELL = f"{BIN_DIR}/sh"
KILL_SIGNAL = "SIGUSR1"
MAX_TRAILER = 8192  # longest trailer line (a D line holds a path of at most PATH_MAX)

_HEADER = struct.Struct(">BxxxL")  # docker's multiplexed stream frame header (tty=False)
HEADER_SIZE = _HEADER.size


def frame_length(header: bytes) -> int:
    return _HEADER.unpack(header)[1]


def new_nonce() -> str:
    return secrets.token_hex(8)


def restart_marker(secret: str) -> bytes:
    return f"<conveyor: session shell restarted {secret}>".encode()


def parse_user(user: str) -> tuple[int, int]:
    """``"uid:gid"`` or ``"uid"`` (numeric) -> (uid, gid); commands never run as root."""
    uid, _, gid = user.partition(":")
    if not uid.isdigit() or not (gid or uid).isdigit():
        raise ValueError(f"the sandbox user must be numeric 'uid:gid', got {user!r}")
    if int(uid) == 0:
        raise ValueError("commands cannot run as root: the session shell's isolation needs another uid")
    return int(uid), int(gid or uid)


DROP = "__cv_drop"  # DROP SCRIPT ARG0 ARGS...: exec `sh -c SCRIPT ARG0 ARGS` as the sandbox user


def probe_command(uid: int) -> str:
    """Root-shell command: which tool can drop to ``uid`` here. Prints ``setpriv`` (util-linux),
    ``su:<name>`` (busybox su needs the name /etc/passwd gives the uid) or ``none``."""
    return (f"if setpriv --help 2>&1 | grep -q reuid; then echo setpriv; "
            f"else n=$(awk -F: '$3=={uid} {{print $1; exit}}' /etc/passwd); "
            f"if [ -n \"$n\" ] && command -v su >/dev/null; then echo \"su:$n\"; else echo none; fi; fi")


# Whether the sandbox user can execute the unreadable shell: Linux can, gVisor refuses to execute
# a file its user cannot read (EACCES). Without it there is no worker: one drop per command.
_WORKER_RUNS = f"( {DROP} {shlex.quote(f'exec {WORKER_SHELL} -c :')} sh ) </dev/null >/dev/null 2>&1"


def open_lines(uid: int, gid: int, secret: str, nonce: str) -> bytes:
    """The first thing the session sends (forks are fine: nothing of the agent runs yet): finds the
    drop tool (``probe_command``), makes the FIFOs and the worker's unreadable shell, installs the
    preamble, starts the worker if the sandbox user can execute that shell (``_WORKER_RUNS``),
    and answers ``<nonce> D<tool> <worker?>`` and ``<nonce> R0``."""
    setup = (f"__cv_tool=$({probe_command(uid)}); mkfifo -m 600 {GO_FIFO} {STATUS_FIFO} 2>/dev/null; "
             f"{{ install -m 0711 /bin/sh {WORKER_SHELL} || {{ cat /bin/sh >{WORKER_SHELL} && chmod 0711 {WORKER_SHELL}; }}; }}"
             " 2>/dev/null\n")
    report = (f'__cv_ok=; [ "$__cv_tool" != none ] && [ -p {GO_FIFO} ] && {_WORKER_RUNS} && __cv_wstart '
              f'&& __cv_ok=worker; __cv_say {nonce} "D$__cv_tool $__cv_ok"; __cv_say {nonce} R0\n')
    return setup.encode() + preamble(secret, None, uid, gid) + report.encode()


# The worker: a shell of the sandbox user running a copy of sh that it cannot read, so the kernel
# makes it non-dumpable: no process of the sandbox user can read or write its memory or its
# descriptors. Per "go" line it marks the cwd file "S", runs the command script in a forked
# subshell (no exec: as fast as the shell's own fork) and reports the subshell's status as waited for.
_WORKER_LOOP = (
    "echo ready >&5; while read -r __n __c <&4; do echo S >&3; "
    f"( unset __n; exec 4<&- 5>&-; . {CMD_PREFIX}$__c; __cv_r=$?; printf '%s\\n' \"$PWD\" >&3; exit $__cv_r ) "
    "</dev/null 2>&1 & wait $!; __r=$?; __d=; "
    f"{{ read -r __d; read -r __d; }} <{CWD_FILE}; __i=0; "
    "until printf '%s D%s\\n%s R%s\\n' \"$__n\" \"$__d\" \"$__n\" \"$__r\"; do "
    "__i=$((__i+1)); [ $__i -lt 1000 ] || break; done; __n=; echo $__r >&5; done"
)


def worker_definitions() -> str:
    """Fork-free root-shell code defining ``__cv_run NONCE TOKEN SCRIPT`` on top of the worker.

    Root writes SCRIPT to ``CMD_PREFIX<token>`` (emptying the previous one, so a background job
    that learnt an earlier token reads nothing of later commands) and "nonce token" as one line
    to ``GO_FIFO``. The worker marks
    ``CWD_FILE`` with "S", runs SCRIPT in a forked subshell (which unsets the nonce before the
    script runs), prints both trailers itself once ``wait`` returns, and sends the status to root,
    which only watches: a worker that died before taking the line (the agent may kill it: same
    uid) is replaced and the new one takes it; one that died during the command gets ``R?`` from
    root. After the USR1 kill nothing is restarted until the next command. Re-sent to the same
    shell, the worker is kept."""
    launcher = f'exec {WORKER_SHELL} -c "$1"'
    start = (f"{DROP} {shlex.quote(launcher)} sh {shlex.quote(_WORKER_LOOP)} "
             f"</dev/null 2>&1 4<&7 5>{STATUS_FIFO} 3>>{CWD_FILE} 7<&- 8<&- & __cv_w=$!; ")
    started = f"__cv_s=; __cv_d=; {{ read -r __cv_s; read -r __cv_d; }} <{CWD_FILE}; "
    return (
        f': "${{__cv_w:=}}"; [ -p {GO_FIFO} ] && exec 7<>{GO_FIFO}; '
        f"__cv_wstart() {{ exec 8<>{STATUS_FIFO}; {start}"
        f"__cv_x=; read -r __cv_x <&8; exec 9<{STATUS_FIFO}; exec 8<&9 9<&-; }}; "
        "__cv_wdead() { kill -9 $__cv_w 2>/dev/null; wait $__cv_w 2>/dev/null; exec 8<&-; __cv_w=; }; "
        f'__cv_run() {{ [ -z "$__cv_cf" ] || true >"$__cv_cf"; __cv_cf={CMD_PREFIX}$2; '
        f"printf '%s' \"$3\" >\"$__cv_cf\"; true >{CWD_FILE}; __cv_k=; "
        "[ -n \"$__cv_w\" ] || __cv_wstart; echo $1 $2 >&7; __cv_r=; read -r __cv_r <&8; "
        "[ -n \"$__cv_r\" ] && return 0; __cv_wdead; " + started +
        '[ -n "$__cv_s$__cv_k" ] || { __cv_wstart; read -r __cv_r <&8; [ -n "$__cv_r" ] && return 0; __cv_wdead; '
        + started + '}; __cv_say $1 "D$__cv_d"; __cv_say $1 "R?"; }; '
    )


def drop_definition(uid: int, gid: int) -> str:
    """Shell code defining ``DROP`` without forking; it uses the tool ``probe_command`` found
    (``$__cv_tool``). Both tools leave the command with no capabilities (a uid change from 0
    clears them)."""
    return (
        f'{DROP}() {{ case $__cv_tool in '
        f'setpriv) exec setpriv --reuid={uid} --regid={gid} --clear-groups -- sh -c "$@";; '
        f'su:*) exec su -p -s /bin/sh "${{__cv_tool#su:}}" -c "$@";; '
        f"*) echo 'conveyor: no way to drop privileges in this image (setpriv or su)' >&2; exit 126;; esac; }}; "
    )


def preamble(secret: str, tool: str | None, uid: int = 65534, gid: int = 65534) -> bytes:
    """Defines ``__cv_say``, installs the traps, then ``DROP`` for ``tool`` (None: as probed by
    ``open_lines``) and the worker functions; re-sent after a restart or a kill. Nothing here
    forks: it must work while a fork bomb holds every pid.

    __cv_say NONCE TEXT prints one trailer line, retrying: a write to a full stdout pipe fails with
    EINTR when a SIGCHLD arrives (ash installs its handler without SA_RESTART). USR1 kills every
    other process. EXIT (the shell failed to fork a command and gives up) replaces PID 1 by a
    fresh shell on the same stdin: exec needs no fork, so the sandbox survives pid exhaustion.
    """
    marker = restart_marker(secret).decode()
    return (
        "__cv_say() { __cv_i=0; until printf '%s %s\\n' \"$1\" \"$2\"; do "
        "__cv_i=$((__cv_i+1)); [ $__cv_i -lt 1000 ] || return 1; done; }; "
        "trap '__cv_k=1; kill -9 -1' USR1; "
        f"trap '__cv_say \"{marker}\" \"\"; exec sh' EXIT; "
        + (f"__cv_tool={shlex.quote(tool)}; " if tool is not None else "")
        + drop_definition(uid, gid) + worker_definitions() + "\n"
    ).encode()


def sync_line(nonce: str) -> bytes:
    """A no-op command whose answer marks a point in the stream (used to resynchronise)."""
    return f"__cv_say {nonce} R0\n".encode()


_WAIT = (
    # A trapped USR1 interrupts `wait` (status > 128) while the killed job may still be a zombie.
    "wait $!; __cv_r=$?; "
    "while [ $__cv_r -gt 128 ] && kill -0 $! 2>/dev/null; do wait $!; __cv_r=$?; done; "
)
_AS_USER = 'cd "$1" 2>/dev/null; eval "$2"; __cv_r=$?; printf "%s" "$PWD" >&3 2>/dev/null; exit $__cv_r'


def command_lines(command: str, nonce: str, cwd: str, *, as_root: bool = False, worker: bool = False) -> bytes:
    """One command as the sandbox user (through the ``worker`` when there is one); ``as_root`` only
    for commands the grader composes itself (never text from the agent): they run in the root
    shell's context, without a cwd report."""
    if as_root:
        return (f"( cd {shlex.quote(cwd)} 2>/dev/null; eval {shlex.quote(command)} ) </dev/null 2>&1 & "
                f"{_WAIT}__cv_say {nonce} R$__cv_r\n").encode()
    if worker:
        script = f"cd -- {shlex.quote(cwd)} 2>/dev/null\n{command}\n"
        return f"__cv_run {nonce} {new_nonce()} {shlex.quote(script)}\n".encode()
    return (
        f"{DROP} {shlex.quote(_AS_USER)} sh {shlex.quote(cwd)} {shlex.quote(command)} "
        f"</dev/null 2>&1 3>{CWD_FILE} & {_WAIT}"
        f"__cv_d=; read -r __cv_d <{CWD_FILE}; __cv_say {nonce} \"D$__cv_d\"; __cv_say {nonce} R$__cv_r\n"
    ).encode()


class CommandStream:
    """Collects one command's bytes until its ``R`` trailer; keeps at most ``max_output`` bytes.

    Trailers start with ``<nonce> `` and end at a newline (``D``, ``R``). Every other byte is
    output: the command's, or stray output of its background jobs between trailers. Bytes after
    the ``R`` line belong to the next command (``leftover``). Linear time: each byte is scanned a
    bounded number of times, and at most ``MAX_TRAILER`` bytes wait unclassified.
    """

    def __init__(self, nonce: str, max_output: int, restart: bytes | None = None):
        self._marker = f"{nonce} ".encode()
        self._restart = restart
        self._keep = max(len(self._marker), len(restart or b"")) - 1  # a marker's prefix may end the buffer
        self._max = max_output
        self._buf = bytearray()  # not yet classified: may hold a partial marker or trailer
        self._scanned = 0  # bytes of a trailer in _buf already searched for its newline
        self.output = bytearray()
        self.total = 0  # output bytes, kept or not
        self.received = 0  # every byte fed before the end, trailers included
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
        self.received += len(data)
        buf = self._buf
        start = max(0, len(buf) - self._keep)
        buf += data
        if self._restart is not None:
            restart = buf.find(self._restart, start)
            if restart >= 0:
                self._emit(buf[:restart])
                self.restarted = self.done = True
                self.leftover = bytes(buf[restart + len(self._restart) :])
                buf.clear()
                return
        marker = self._marker
        while True:
            if not buf.startswith(marker):
                at = buf.find(marker)
                if at < 0:
                    if len(buf) > self._keep:
                        cut = len(buf) - self._keep
                        self._emit(buf[:cut])
                        del buf[:cut]
                    return
                self._emit(buf[:at])
                del buf[:at]
                self._scanned = 0
            newline = buf.find(b"\n", max(len(marker), self._scanned), MAX_TRAILER)
            if newline < 0:
                if len(buf) < MAX_TRAILER:
                    self._scanned = len(buf)
                    return  # the rest of this trailer has not arrived yet
                self._emit(buf[:1])  # too long for a trailer: output, and look further on
                del buf[:1]
                self._scanned = 0
                continue
            kind = bytes(buf[len(marker) : len(marker) + 1])
            value = bytes(buf[len(marker) + 1 : newline]).decode(errors="replace")
            del buf[: newline + 1]
            self._scanned = 0
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
