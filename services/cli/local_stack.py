"""Conveyor as local processes: Redis, an object store, vLLM, Celery workers, the trainer.

Used by ``conveyor demo`` and by the end-to-end tests, so both exercise the same real
processes. Invariants:
- State is durable by default. Redis writes an append-only file (``appendonly yes``,
  ``appendfsync everysec``) under the stack's directory, so a restarted Redis (``stop_redis``,
  then ``start_redis`` on ``redis_port``) comes back with the ledger and the queues, at most one
  second of writes lost on a crash and none on a clean stop. The object store is the filesystem
  backend under the stack's directory (``start_object_store``); moto, which keeps objects in
  memory and loses them when it stops, only when asked for (``start_s3``).
- Every process gets its own log file under the stack's directory, and its own process group,
  so ``stop()`` ends it and everything it spawned (Celery's pool, vLLM's engine): SIGTERM, then
  SIGKILL to what is left of the group. Each is started with ``start_group_leader``, so the
  same happens (by the process-group guard) even if the process that started the stack is killed with
  SIGKILL.
- Settings reach the child processes as ``CONVEYOR_*`` environment variables, the same way a
  user configures a deployment.
- ``stop()`` runs in reverse start order and never raises; it is safe to call twice.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from shared.processes import die_with_parent, release_group, start_group_leader
from shared.redis_clients import redis_for


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (``0.0.0.0``: free on every interface), for a server that
    listens on it later.

    Never the same port twice in one process: two ports asked for before either server
    listens were once the same (``bind(0)`` handed vLLM's port out again for the trainer's
    weight group, which then failed with ``EADDRINUSE``). Drawn outside the kernel's ephemeral
    range, which the stack's many short outgoing connections (to Redis, S3, vLLM) draw from
    too. Falls back to the kernel's choice when no such port is free.
    """
    low, high = _ephemeral_range()
    for _ in range(64):
        port = random.randrange(10_000, 65_536)
        if low <= port <= high or port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    while True:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


_HANDED_OUT: set[int] = set()


def _wait_for_port(port: int, timeout_s: float, proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}:\n{log_tail(log_path)}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listened on port {port} within {timeout_s}s:\n{log_tail(log_path)}")


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


@dataclass
class ManagedProcess:
    name: str
    proc: subprocess.Popen
    log_path: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.alive():
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                self.proc.wait(5)
        self.kill(signal.SIGKILL)  # whatever of its group outlived the leader
        release_group(self.proc.pid)


@dataclass
class LocalStack:
    root: Path
    run_id: str = "demo"
    env: dict[str, str] = field(default_factory=dict)
    processes: list[ManagedProcess] = field(default_factory=list)
    redis_port: int | None = None

    def __post_init__(self) -> None:
        self.root = Path(self.root).resolve()
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        self.env.setdefault("CONVEYOR_RUN_ID", self.run_id)
        self.env.setdefault("CONVEYOR_TRAINER__METRICS_PATH", str(self.root / "metrics.jsonl"))
        self.env.setdefault("CONVEYOR_INFERENCE__WEIGHTS_DIR", str(self.root / "weights"))

    # --- generic ----------------------------------------------------------------------------
    def spawn(self, name: str, argv: list[str], extra_env: dict[str, str] | None = None) -> ManagedProcess:
        log_path = self.root / "logs" / f"{name}.log"
        env = {**os.environ, **self.env, **(extra_env or {})}
        with log_path.open("ab") as log:
            proc = start_group_leader(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=os.getcwd())
        managed = ManagedProcess(name, proc, log_path)
        self.processes.append(managed)
        return managed

    def conveyor(self, name: str, *args: str, extra_env: dict[str, str] | None = None) -> ManagedProcess:
        return self.spawn(name, [sys.executable, "-m", "services.cli.app", *args], extra_env)

    def run_conveyor(self, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "services.cli.app", *args], env={**os.environ, **self.env},
            capture_output=True, text=True, timeout=timeout_s, preexec_fn=die_with_parent(),
        )

    # --- components -------------------------------------------------------------------------
    def start_redis(self, port: int | None = None, appendfsync: str = "everysec") -> str:
        """Redis with its append-only file in ``root/redis``; again on the same port and
        directory (a restart), it reloads what it held. ``appendfsync``: ``everysec`` (a crash
        of the machine or a SIGKILL may lose the last second of writes) or ``always``."""
        binary = shutil.which("redis-server")
        if not binary:
            raise RuntimeError("redis-server is not installed (Debian/Ubuntu: apt-get install -y redis-server)")
        port = port or free_port()
        data_dir = self.root / "redis"
        data_dir.mkdir(exist_ok=True)
        proc = self.spawn("redis", [
            binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir), "--save", "",
            "--appendonly", "yes", "--appendfsync", appendfsync,
        ])
        _wait_for_port(port, 10, proc.proc, proc.log_path)
        url = f"redis://127.0.0.1:{port}/0"
        self.env["CONVEYOR_REDIS__URL"] = url
        self.redis_port = port
        return url

    def process(self, name: str) -> ManagedProcess:
        return next(p for p in reversed(self.processes) if p.name == name)

    def stop_redis(self) -> None:
        """A clean stop (SIGTERM): Redis flushes its append-only file first. ``start_redis``
        with ``redis_port`` starts it again where the services look for it."""
        redis_proc = self.process("redis")
        redis_proc.stop()
        self.processes.remove(redis_proc)

    def start_object_store(self) -> Path:
        """The durable default: the filesystem backend under ``root/objects`` (every process
        of the stack shares the directory)."""
        root = self.root / "objects"
        root.mkdir(exist_ok=True)
        self.env.update({"CONVEYOR_STORAGE__BACKEND": "local", "CONVEYOR_STORAGE__LOCAL_ROOT": str(root)})
        return root

    def start_s3(self) -> str:
        """moto's S3 server: in memory, so only when asked for (tests of the S3 path)."""
        port = free_port()
        proc = self.spawn("s3", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)])
        _wait_for_port(port, 30, proc.proc, proc.log_path)
        endpoint = f"127.0.0.1:{port}"
        self.env.update({
            "CONVEYOR_STORAGE__BACKEND": "s3", "CONVEYOR_STORAGE__ENDPOINT": endpoint,
            "CONVEYOR_STORAGE__ACCESS_KEY": "testing", "CONVEYOR_STORAGE__SECRET_KEY": "testing",
        })
        return endpoint

    def use_inference(self, base_url: str, model_path: Path, served_name: str) -> None:
        self.env.update({
            "CONVEYOR_INFERENCE__BASE_URL": base_url,
            "CONVEYOR_INFERENCE__MODEL_PATH": str(model_path),
            "CONVEYOR_INFERENCE__MODEL": served_name,
        })

    def start_rollout_worker(self, name: str = "rollout", concurrency: int = 8) -> ManagedProcess:
        return self.conveyor(f"worker-{name}", "worker", "rollout", "--name", name, "--concurrency", str(concurrency))

    def start_scoring_worker(self, name: str = "scoring") -> ManagedProcess:
        return self.conveyor(f"worker-{name}", "worker", "scoring", "--name", name)

    def start_weight_follower(self, name: str = "weight-follower") -> ManagedProcess:
        return self.conveyor(name, "inference", "--attach")

    def start_trainer(self, exit_when_done: bool = False) -> ManagedProcess:
        args = ["trainer"] + (["--exit-when-done"] if exit_when_done else [])
        return self.conveyor("trainer", *args)

    def redis_client(self) -> redis.Redis:
        return redis_for(self.env["CONVEYOR_REDIS__URL"])  # the ledger's Redis: one server or a cluster

    def logs(self, name: str, lines: int = 40) -> str:
        return log_tail(self.root / "logs" / f"{name}.log", lines)

    def stop(self) -> None:
        for managed in reversed(self.processes):
            try:
                managed.stop()
            except Exception:  # keep stopping the rest
                managed.kill()
        self.processes.clear()

    def __enter__(self) -> "LocalStack":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
