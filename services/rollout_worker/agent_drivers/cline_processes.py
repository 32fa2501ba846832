"""Cline's two processes in the sandbox: the Go host bridge (``cline-host``) and the core
(``node cline-core.js``, the ProtoBus gRPC server), on free loopback ports.

Invariants:
- Both bind loopback ports picked here; the core waits for the host's health check, so the host
  starts first. Everything they write (config, data, task files, logs, ``~/Cline``) lives under
  ``state_dir``: the sandbox's root filesystem is read-only.
- Their environment is built here from scratch: no API key or other secret in it (the core logs
  its whole environment at start); the key reaches the core over gRPC only.
- They stay in the driver's process group, so the sandbox wrapper's group kill reaches them even
  if the driver itself is killed. ``stop`` ends the core (which shuts the host down), then the
  host, then kills whatever else descends from the driver (commands Cline started), and reports
  what was still alive after that.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ClineLayout:
    package: Path  # node_modules/cline: cline-core.js, bin/cline-host, proto/descriptor_set.pb
    state_dir: Path

    @property
    def config_dir(self) -> Path:
        return self.state_dir / "config"

    @property
    def home(self) -> Path:
        return self.state_dir / "home"

    @property
    def logs(self) -> Path:
        return self.state_dir / "logs"

    @property
    def descriptor_set(self) -> Path:
        return self.package / "proto" / "descriptor_set.pb"

    def task_dir(self, task_id: str) -> Path:
        return self.config_dir / "data" / "tasks" / task_id


def free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class ClineProcesses:
    layout: ClineLayout
    workspace: Path
    host_port: int = field(default_factory=free_loopback_port)
    core_port: int = field(default_factory=free_loopback_port)
    host: subprocess.Popen | None = None
    core: subprocess.Popen | None = None

    @property
    def core_address(self) -> str:
        return f"127.0.0.1:{self.core_port}"

    def start(self) -> None:
        layout = self.layout
        for directory in (layout.config_dir, layout.home, layout.logs):
            directory.mkdir(parents=True, exist_ok=True)
        env = {"HOME": str(layout.home), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
               "NODE_PATH": f"{layout.package}/node_modules:{layout.package}/fake_node_modules"}
        self.host = self._spawn("host", [str(layout.package / "bin" / "cline-host"), "--port", str(self.host_port),
                                         "--workspace", str(self.workspace)], env, cwd=self.workspace)
        self.core = self._spawn("core", ["node", str(layout.package / "cline-core.js"), "--port", str(self.core_port),
                                         "--host-bridge-port", str(self.host_port), "--config", str(layout.config_dir)],
                                env, cwd=layout.package)

    def dead(self) -> str | None:
        """Which process has exited, and how, or None while both run."""
        for name, process in (("cline-host", self.host), ("cline-core", self.core)):
            if process is not None and process.poll() is not None:
                return f"{name} exited with {process.returncode} (see {self.layout.logs / name}.log)"
        return None

    def stop(self, grace_s: float = 3.0) -> dict:
        """Stop everything; return the exit codes and how many of the driver's descendants were
        still alive at the end. Descendants are listed first: once the core is gone, the commands
        it started are re-parented away from the driver."""
        started_here = set(descendants(os.getpid()))
        for process in (self.core, self.host):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=grace_s)
        started_here |= set(descendants(os.getpid()))
        for pid in started_here:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
        return {"core_exit": None if self.core is None else self.core.returncode,
                "host_exit": None if self.host is None else self.host.returncode,
                "left_running": sum(is_alive(pid) for pid in started_here)}

    def _spawn(self, name: str, argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
        log = open(self.layout.logs / f"cline-{name}.log", "wb")
        try:
            return subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()


def _state_and_parent(pid: int) -> tuple[str, int] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, ppid = stat.rsplit(")", 1)[1].split()[:2]
    return state, int(ppid)


def is_alive(pid: int) -> bool:
    found = _state_and_parent(pid)
    return found is not None and found[0] != "Z"


def descendants(root: int) -> list[int]:
    """Live descendants of ``root`` (zombies excluded), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        found = _state_and_parent(int(entry))
        if found is not None and found[0] != "Z":
            children.setdefault(found[1], []).append(int(entry))
    alive, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            alive.append(child)
            todo.append(child)
    return alive
