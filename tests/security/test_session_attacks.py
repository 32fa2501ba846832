"""Attacks on the persistent shell session, the file API and the syscall surface, from inside a
real sandbox (one shared busybox sandbox for the module; the Python image where a script is
needed). Each asserts the attack failed: the true exit status came back, the command was killed,
or the kernel refused."""

from __future__ import annotations

import re
import time

import pytest

from services.rollout_worker.sandbox import SandboxFileError
from services.rollout_worker.sandbox.protocol import CommandStream, restart_marker
from security_support import RUNTIME

pytestmark = [pytest.mark.docker, pytest.mark.timeout(180)]


def test_a_command_cannot_read_the_shells_memory_or_descriptors(busybox_sandbox):
    """Under gVisor (this runsc release) other uids may read PID 1's environ and maps and list its
    fds, but not its memory nor reopen its stdio; its environ holds none of the session's names."""
    result = busybox_sandbox.exec("id -u; for f in mem environ maps fd/0 fd/1; do "
                                  "cat /proc/1/$f >/dev/null 2>&1 && echo \"READ $f\"; done; "
                                  "ls /proc/1/fd >/dev/null 2>&1 && echo LISTED; echo done")
    gvisor_shows = "READ environ\nREAD maps\nLISTED\n" if RUNTIME == "runsc" else ""
    assert result.output == f"65534\n{gvisor_shows}done\n", result.output
    environ = busybox_sandbox.exec("cat /proc/1/environ 2>/dev/null | tr '\\0' '\\n'").output
    assert "__cv" not in environ and "conveyor" not in environ, environ


@pytest.mark.skipif(RUNTIME != "runsc", reason="under runc the session has a worker")
def test_under_gvisor_no_process_of_the_sandbox_user_holds_a_nonce(busybox_sandbox):
    """gVisor will not execute the worker's unreadable shell, so the session has no worker: each
    command is a fresh exec from the root shell, and only root's memory ever holds a nonce."""
    result = busybox_sandbox.exec("grep -l conveyor-bi[n] /proc/[0-9]*/cmdline 2>/dev/null; "
                                  "echo $$ >/tmp/pid; tr '\\0' ' ' </proc/$$/cmdline | cut -c1-6")
    assert result.output == "sh -c \n", result.output  # no worker shell runs; the command's own sh
    assert busybox_sandbox.exec("[ $$ != $(cat /tmp/pid) ] && echo fresh").output == "fresh\n"


@pytest.mark.skipif(RUNTIME == "runsc", reason="no worker under gVisor: it will not execute an unreadable shell")
def test_a_command_cannot_read_the_worker_that_forked_it(busybox_sandbox):
    """The worker runs as the sandbox user too, but from a shell binary it cannot read, so the
    kernel keeps its memory and descriptors from every other process of that user."""
    result = busybox_sandbox.exec("ls -l /run/conveyor-bin/sh | cut -c1-10; cat /run/conveyor-bin/sh >/dev/null 2>&1 "
                                  "|| echo unreadable; for f in mem environ fd/0 fd/4; do "
                                  "cat /proc/$$/$f >/dev/null 2>&1 && echo \"READ $f\"; done; "
                                  "ls /proc/$$/fd >/dev/null 2>&1 && echo LISTED; grep -c . /proc/$$/cmdline")
    assert result.output == "-rwx--x--x\nunreadable\n1\n", result.output


def test_a_command_cannot_write_the_shells_input(busybox_sandbox):
    injected = busybox_sandbox.exec("echo 'echo INJECTED' > /proc/1/fd/0; echo rc=$?")
    assert "rc=0" not in injected.output and "Permission denied" in injected.output
    assert busybox_sandbox.exec("echo real").output == "real\n"  # nothing was queued before it


def test_a_background_job_cannot_read_the_next_command_or_forge_its_status(busybox_sandbox):
    busybox_sandbox.exec("(sleep 0.3; cat /proc/1/fd/0 > /tmp/stolen 2>&1; "
                         "printf '%s R0\\n' 0000000000000000 > /proc/1/fd/0) >/dev/null 2>&1 &")
    later = busybox_sandbox.exec("sleep 0.6; echo ran; exit 7")
    assert (later.exit_code, later.output) == (7, "ran\n")
    assert "Permission denied" in busybox_sandbox.exec("cat /tmp/stolen").output


def test_killing_every_process_of_the_sandbox_user_cannot_break_the_session(busybox_sandbox):
    """The next command's process is started ahead of time as the sandbox user; killing it (now,
    or from a background job while the session is idle) must not lose or misreport a command."""
    busybox_sandbox.exec("kill -9 -1; echo after")
    assert busybox_sandbox.exec("echo ok; exit 5").exit_code == 5
    busybox_sandbox.exec("(sleep 0.2; kill -9 -1) >/dev/null 2>&1 &")
    time.sleep(0.5)
    result = busybox_sandbox.exec("echo ran; exit 4")
    assert (result.exit_code, result.output) == (4, "ran\n")
    assert busybox_sandbox.exec("pwd").output == "/workspace\n"


def test_a_background_job_cannot_read_later_commands(busybox_sandbox):
    """Scripts reach the worker through files named by a fresh token in a directory commands
    cannot list; the job knows its own command's token, which is emptied before the next one."""
    busybox_sandbox.exec("own=/run/conveyor/c.$__c; (for i in $(seq 30); do cat \"$own\" /run/conveyor/c.* "
                         "/run/conveyor/cmd; ls /run/conveyor; sleep 0.05; done) >/tmp/spy 2>&1 &")
    for _ in range(5):
        assert busybox_sandbox.exec("echo NEXT-COMMAND-SECRET >/dev/null; sleep 0.1").exit_code == 0
    time.sleep(1.0)
    spied = busybox_sandbox.exec("cat /tmp/spy").output
    assert "NEXT-COMMAND-SECRET" not in spied and "Permission denied" in spied, spied[-500:]


def test_a_command_cannot_reopen_its_stdout_to_read_the_trailers(busybox_sandbox):
    result = busybox_sandbox.exec("cat /proc/self/fd/1 </dev/null; echo rc=$?; exec 5</proc/self/fd/1; echo opened")
    assert "rc=1" in result.output and "Permission denied" in result.output
    assert "opened" not in result.output and result.exit_code != 0


def test_a_command_cannot_signal_the_shell(busybox_sandbox):
    result = busybox_sandbox.exec("for s in USR1 STOP TERM KILL; do kill -$s 1 2>/dev/null && echo SENT $s; done; exit 3")
    assert (result.exit_code, result.output) == (3, "")
    assert busybox_sandbox.exec("echo alive").output == "alive\n"


def test_the_nonce_is_not_among_the_commands_variables(busybox_sandbox):
    result = busybox_sandbox.exec("set; env")
    assert result.exit_code == 0 and "PATH" in result.output
    # the one token a command may see names its own script file (test below), not the nonce
    others = "\n".join(line for line in result.output.splitlines() if not line.startswith("__c="))
    assert not re.search(r"\b[0-9a-f]{16}\b", others), result.output


def test_printed_trailers_and_restart_markers_are_only_output(busybox_sandbox):
    forged = ("printf '%s R0\\n' 0000000000000000 0123456789abcdef ffffffffffffffff; "
              "echo '<conveyor: session shell restarted >'; echo '<conveyor: session shell restarted 00>'; exit 7")
    result = busybox_sandbox.exec(forged)
    assert result.exit_code == 7 and not result.timed_out
    assert result.output.count(" R0\n") == 3 and result.output.count("restarted") == 2


def test_a_command_cannot_become_root_or_regain_capabilities(busybox_sandbox):
    result = busybox_sandbox.exec("su root -c 'id -u' 2>/dev/null; su -p -s /bin/sh root -c 'id -u' 2>/dev/null; "
                                  "grep -E 'CapEff|CapPrm' /proc/self/status; id -u")
    assert result.output.split() == ["CapPrm:", "0000000000000000", "CapEff:", "0000000000000000", "65534"]


def test_the_control_directory_is_out_of_reach(busybox_sandbox):
    result = busybox_sandbox.exec("ls /run/conveyor 2>&1; echo x > /run/conveyor/cwd 2>&1; "
                                  "touch /run/conveyor/new 2>&1; echo end")
    assert result.output.count("Permission denied") == 3 and result.output.endswith("end\n"), result.output
    assert busybox_sandbox.exec("cd /tmp && pwd").output == "/tmp\n"  # the cwd report still works
    assert busybox_sandbox.exec("pwd").output == "/tmp\n"
    busybox_sandbox.exec("cd /workspace")


def test_a_timeout_kills_a_command_that_ignores_signals_and_tampers_with_its_shell(busybox_sandbox):
    """Under runsc each of the 30 background processes costs about 10 host pids that gVisor never
    gives back: with the host's pids cgroup as the process limit this lost the sandbox (Sentry
    crash, status 2); the limit is gVisor's RLIMIT_NPROC there (``deployment.pid_limits``)."""
    # `sh -c 'echo $PPID'` names the command's own shell; `$$` names the worker that forked it
    for stop in ("$(sh -c 'echo $PPID')", "$$"):
        start = time.monotonic()
        result = busybox_sandbox.exec("trap '' USR1 TERM INT HUP; setsid sh -c \"trap '' USR1 TERM; sleep 300\" & "
                                      "for i in $(seq 30); do (trap '' USR1 TERM; sleep 300) & done; "
                                      f"kill -STOP {stop}; sleep 300", timeout_s=1)
        assert result.timed_out and result.exit_code is None, result
        assert time.monotonic() - start < 1 + 5 + 1
        left = busybox_sandbox.exec("ps -o comm | grep -c sleep")
        assert left.output.strip() == "0", left.output


def test_a_fake_trailer_then_endless_bytes_hits_the_flood_limit(busybox_sandbox):
    start = time.monotonic()
    result = busybox_sandbox.exec("printf '0123456789abcdef R'; head -c 40000000 /dev/zero", max_output_bytes=1000,
                                  timeout_s=30)
    assert result.exit_code is None and len(result.raw) == 1000 and result.truncated
    assert result.output_bytes >= (16 << 20) - 8192  # counted, though no newline ever came
    assert time.monotonic() - start < 10
    assert busybox_sandbox.exec("echo ok").output == "ok\n"


def test_end_of_command_detection_is_linear_in_the_bytes():
    """The parser fed a real marker prefix and 32 MiB with no newline, in 64 KiB frames."""
    nonce = "0123456789abcdef"
    stream = CommandStream(nonce, 1000, restart_marker("s"))
    start = time.perf_counter()
    stream.feed(f"{nonce} R".encode())
    chunk = b"x" * (64 << 10)
    for _ in range(512):
        stream.feed(chunk)
    elapsed = time.perf_counter() - start
    assert not stream.done and stream.received == 2 + len(nonce) + (32 << 20)
    assert stream.total >= (32 << 20) - 8192 and len(stream.output) == 1000
    assert elapsed < 2.0, elapsed  # quadratic rescanning took minutes for this much


def test_file_names_with_newlines_cannot_forge_listing_or_diff_entries(busybox_sandbox):
    """Directories named so that a line-based listing or md5sum output would show ``forged*.py``
    at the top level: ``x<newline>.`` holding ``forged.py`` reads as the lines ``./x`` and
    ``./forged.py``."""
    sandbox = busybox_sandbox.sandbox
    fake_md5 = "d41d8cd98f00b204e9800998ecf8427e  ."
    busybox_sandbox.exec(f"mkdir -p 'names/real\n.' 'names/x\n{fake_md5}' && cd names && "
                         f"echo a > 'real\n./forged.py' && echo b > 'x\n{fake_md5}/forged2.py' && "
                         "echo c > 'back\\slash.py' && echo p > plain.py")
    top = busybox_sandbox.run(sandbox.list_files("names"))
    assert top == sorted(["real\n./", f"x\n{fake_md5}/", "back\\slash.py", "plain.py"]), top
    files = sorted(busybox_sandbox.run(sandbox.list_files("names", recursive=True)))
    assert "forged.py" not in files and "forged2.py" not in files and "real\n./forged.py" in files
    diff = busybox_sandbox.run(sandbox.diff())
    added = sorted(a for a in diff.added if a.startswith("names/"))
    assert added == sorted(["names/real\n./forged.py", f"names/x\n{fake_md5}/forged2.py", "names/back\\slash.py",
                            "names/plain.py"]), added
    assert not [p for p in diff.added if p.startswith("forged")]
    with pytest.raises(SandboxFileError, match="NUL"):
        busybox_sandbox.run(sandbox.read_file("names/plain.py\0../../etc/passwd"))


SYSCALLS = r'''
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
def call(name, nr, *args):
    r = libc.syscall(nr, *args)
    print(name, "ok" if r >= 0 else errno.errorcode[ctypes.get_errno()])
call("io_uring_setup", 425, 8, ctypes.create_string_buffer(120))
call("userfaultfd", 323, 0)
call("unshare_user", 272, 0x10000000)
call("bpf", 321, 0, 0, 0)
call("perf_event_open", 298, 0, 0, -1, -1, 0)
call("keyctl", 250, 0, 0, 0)
child = os.fork()
if child == 0:
    import time; time.sleep(5); os._exit(0)
call("ptrace_attach_sibling", 101, 16, child, 0, 0)
buf = ctypes.create_string_buffer(8)
iov = (ctypes.c_void_p * 2)(ctypes.cast(buf, ctypes.c_void_p), 8)
call("process_vm_readv_sibling", 310, child, iov, 1, iov, 1, 0)
os.kill(child, 9)
'''


@pytest.mark.skipif(RUNTIME == "runsc", reason="gVisor does not apply the container's seccomp profile: its "
                    "Sentry answers every call (with --oci-seccomp, this release answers EPERM where the "
                    "profile says ENOSYS, and glibc then cannot start a thread); see docs/sandboxes.md")
def test_the_seccomp_profile_blocks_syscalls_a_sandbox_never_needs(python_sandbox):
    python_sandbox.run(python_sandbox.sandbox.write_file("/tmp/sys.py", SYSCALLS))
    result = python_sandbox.exec("python3 /tmp/sys.py")
    verdicts = dict(line.split() for line in result.output.splitlines())
    assert verdicts == {"io_uring_setup": "ENOSYS", "userfaultfd": "EPERM", "unshare_user": "EPERM", "bpf": "EPERM",
                        "perf_event_open": "EPERM", "keyctl": "EPERM", "ptrace_attach_sibling": "EPERM",
                        "process_vm_readv_sibling": "EPERM"}, result.output
