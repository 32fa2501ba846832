"""A second Docker daemon, standing in for a remote sandbox host: inside a network namespace this
machine creates, reached over a veth pair of its own on TCP with mutual TLS.

The daemon has its own data root, exec root (its own containerd), pidfile, Unix socket and
cgroup parent. It runs with ``--bridge=none --iptables=false``: it creates no bridge and writes
no firewall rule, so it cannot collide with the host daemon's ``docker0`` or its chains. Sandboxes
run with ``network_mode=none``, so nothing they are promised is lost; what this daemon cannot do
is run containers on a bridge network (``snapshot_network: bridge`` builds).

It is entered with ``nsenter --net`` only, not ``ip netns exec``: the latter also remounts /sys in
a mount namespace of its own, where the cgroup hierarchies are not mounted and dockerd refuses to
start ("Devices cgroup isn't mounted").

Certificates (a CA, the daemon's for its address, the worker's) are made per session with
openssl. ``remote_docker_host()`` yields a ``RemoteHost``: the settings of a ``docker`` provider
for it, ``lose()``, which kills the daemon as a lost host would vanish, ``come_back()``, which
starts it again as after a reboot (same data root, empty exec root), and ``silence()`` and
``answer()`` (SIGSTOP, SIGCONT: a host that stays silent, then answers). On exit the daemon is
stopped (its containers with it) and the namespace, link and directories are removed.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import docker
import pytest

from shared.settings.sandbox import DockerProviderSettings, DockerTLSSettings

PORT = 2376
RUNSC = "/usr/bin/runsc"
_hosts = itertools.count()


@dataclass(frozen=True)
class RemoteHost:
    settings: DockerProviderSettings
    lose: Callable[[], None]  # SIGKILL the daemon: the host is gone
    come_back: Callable[[], None]  # start the lost daemon again (same data root), once it answers
    silence: Callable[[], None]  # SIGSTOP the daemon: the host stays silent (connections hang)
    answer: Callable[[], None]  # SIGCONT: it answers again


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def make_certs(where: Path, server_ip: str) -> DockerTLSSettings:
    """A CA, the daemon's certificate for ``server_ip`` and the worker's client certificate."""
    def sign(name: str, subject: str, extensions: str) -> None:
        _run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{where}/{name}-key.pem",
             "-out", f"{where}/{name}.csr", "-subj", subject)
        (where / f"{name}.ext").write_text(extensions)
        _run("openssl", "x509", "-req", "-in", f"{where}/{name}.csr", "-CA", f"{where}/ca.pem", "-CAkey",
             f"{where}/ca-key.pem", "-CAcreateserial", "-out", f"{where}/{name}.pem", "-days", "1",
             "-extfile", f"{where}/{name}.ext")

    _run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{where}/ca-key.pem",
         "-out", f"{where}/ca.pem", "-days", "1", "-subj", "/CN=conveyor-test-ca")
    sign("server", "/CN=conveyor-remote", f"subjectAltName=IP:{server_ip}\nextendedKeyUsage=serverAuth\n")
    sign("client", "/CN=conveyor-worker", "extendedKeyUsage=clientAuth\n")
    return DockerTLSSettings(ca_cert=where / "ca.pem", client_cert=where / "client.pem",
                             client_key=where / "client-key.pem")


def _free_subnet() -> tuple[str, str]:
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    for third in range(os.getpid() % 200, 256):
        if f"10.213.{third}." not in routes:
            return f"10.213.{third}.1", f"10.213.{third}.2"
    raise RuntimeError("no free 10.213.x.0/30 subnet")


@contextlib.contextmanager
def remote_docker_host(runtime: str = "runc") -> Iterator[RemoteHost]:
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "nsenter", "dockerd", "openssl")):
        pytest.skip("a namespaced second dockerd needs root, ip, nsenter, dockerd and openssl")
    if runtime == "runsc" and not os.access(RUNSC, os.X_OK):
        pytest.skip(f"gVisor is not installed ({RUNSC}: apt-get install runsc)")
    tag = f"cvr{os.getpid() % 100000}x{next(_hosts)}"  # at most 15 bytes with the link suffix
    netns, host_if, ns_if = tag, f"{tag}h", f"{tag}n"
    host_ip, daemon_ip = _free_subnet()
    root = Path(tempfile.mkdtemp(prefix="conveyor-remote-", dir="/tmp"))
    daemon: subprocess.Popen | None = None
    try:
        _run("ip", "netns", "add", netns)
        _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _run("ip", "link", "set", ns_if, "netns", netns)
        _run("ip", "addr", "add", f"{host_ip}/30", "dev", host_if)
        _run("ip", "link", "set", host_if, "up")
        for argv in (("addr", "add", f"{daemon_ip}/30", "dev", ns_if), ("link", "set", ns_if, "up"),
                     ("link", "set", "lo", "up")):
            _run("ip", "-n", netns, *argv)
        (root / "certs").mkdir()
        tls = make_certs(root / "certs", daemon_ip)
        certs = root / "certs"
        runtimes = {"runsc": {"path": RUNSC, "runtimeArgs": ["--network=none"]}} if os.access(RUNSC, os.X_OK) else {}
        (root / "daemon.json").write_text(json.dumps({"runtimes": runtimes}))
        log = open(root / "dockerd.log", "wb")
        argv = (["nsenter", f"--net=/var/run/netns/{netns}", "dockerd", "--config-file", f"{root}/daemon.json",
             "--data-root", f"{root}/data", "--exec-root", f"{root}/exec", "--pidfile", f"{root}/docker.pid", "-H", f"unix://{root}/docker.sock",
             "-H", f"tcp://{daemon_ip}:{PORT}", "--tlsverify", "--tlscacert", f"{certs}/ca.pem",
             "--tlscert", f"{certs}/server.pem", "--tlskey", f"{certs}/server-key.pem", "--bridge=none",
             "--iptables=false", "--ip6tables=false", "--ip-masq=false", f"--cgroup-parent={tag}"])
        daemons = [subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)]
        daemon = daemons[0]
        settings = DockerProviderSettings(host=f"tcp://{daemon_ip}:{PORT}", tls=tls, runtime=runtime)
        _wait_until_up(root / "docker.sock", daemon, root / "dockerd.log")

        def come_back() -> None:  # as after a reboot: the old containerd and sandboxes are gone
            _kill(daemons[-1])
            deadline = time.monotonic() + 10
            while _kill_leftovers(root) and time.monotonic() < deadline:  # until none is left
                time.sleep(0.05)
            _unmount_under(root / "exec")  # the exec root is run state, empty after a reboot
            shutil.rmtree(root / "exec", ignore_errors=True)
            daemons.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            _wait_until_up(root / "docker.sock", daemons[-1], root / "dockerd.log")

        yield RemoteHost(settings, lose=lambda: _kill(daemons[-1]), come_back=come_back,
                         silence=lambda: daemons[-1].send_signal(signal.SIGSTOP),
                         answer=lambda: daemons[-1].send_signal(signal.SIGCONT))
    finally:
        if daemon is not None:
            daemons[-1].send_signal(signal.SIGCONT)
            _stop(daemons[-1])
        _kill_leftovers(root)  # a killed daemon leaves its containers' shims running
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        _unmount_under(root)
        shutil.rmtree(root, ignore_errors=True)


def _wait_until_up(sock: Path, daemon: subprocess.Popen, log: Path, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise RuntimeError(f"the namespaced dockerd exited: {log.read_text()[-2000:]}")
        if sock.exists():
            with contextlib.suppress(docker.errors.DockerException):
                docker.DockerClient(base_url=f"unix://{sock}").ping()
                return
        time.sleep(0.1)
    raise RuntimeError(f"the namespaced dockerd did not answer in {timeout_s:.0f}s: {log.read_text()[-2000:]}")


def _kill(daemon: subprocess.Popen | None) -> None:
    if daemon is not None and daemon.poll() is None:
        daemon.kill()
        daemon.wait(10)


def _stop(daemon: subprocess.Popen) -> None:
    daemon.send_signal(signal.SIGTERM)  # dockerd stops its containers and its containerd
    try:
        daemon.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(daemon.pid, signal.SIGKILL)
        daemon.wait(10)


def _kill_leftovers(root: Path) -> int:
    """SIGKILL the containerd and shims of this daemon (their command line names its exec root) and
    the sandbox processes under them; returns how many were still there."""
    shims = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p).find(str(root)) >= 0]
    children = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) in shims]
    for pid in children + shims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(children + shims)


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parent(proc: Path) -> int:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _unmount_under(root: Path) -> None:
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    for mount in sorted((m for m in mounts if m.startswith(f"{root}/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", mount], capture_output=True)
