"""A submitted run's own inference server (``conveyor run submit --inference own``, or ``auto``): a vLLM of the
run's model, launched with its weight follower (``conveyor inference``) as one of the run's
processes, for a run beside another that holds the stack's server while it trains.

Invariants:
- The server listens on every interface of the supervisor's host, on the port given (one that
  a container publishes to other hosts) or else one free there, and is
  named to the rest of the stack as ``http://<address>:<port>``: the address given, or else the
  one this host reaches the ledger's Redis from (on a compose network, the container's address
  there), so the rollout workers, which reach Redis, reach it too.
- Every process of the run gets that URL as ``inference.base_url``, with ``inference.own_server``
  set (intake names the server in each request: ``shared.schemas.InferenceTarget``) and no other
  replica: the run's follower holds only its own server, and no other run's.
- Intake starts only once the server answers (``wait_ready``): no group is published for a server
  that is still loading. The wait says every ``PROGRESS_EVERY_S`` what it waits for, and ends
  with the server's log tail if the launch exits first or ``inference.startup_timeout_s`` passes.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlsplit

from services.cli import errors
from services.cli.local_stack import ManagedProcess, free_port, log_tail
from shared.settings import Settings

PROGRESS_EVERY_S = 10.0
POLL_S = 1.0


class ServerNotUp(Exception):
    """The run's own server exited, or did not answer in time, before intake started."""


@dataclass(frozen=True)
class OwnInference:
    address: str  # how the rollout workers reach this host
    port: int

    @property
    def base_url(self) -> str:
        return f"http://{self.address}:{self.port}"

    @classmethod
    def for_settings(cls, settings: Settings, address: str | None, port: int | None = None) -> "OwnInference":
        return cls(address or address_towards(settings.redis.url), port or free_port("0.0.0.0"))

    def env(self) -> dict[str, str]:
        """The run's processes' inference settings (an environment variable beats its config)."""
        return {"CONVEYOR_INFERENCE__OWN_SERVER": "true", "CONVEYOR_INFERENCE__BASE_URL": self.base_url,
                "CONVEYOR_INFERENCE__REPLICA_URLS": "[]", "CONVEYOR_INFERENCE__HOST": "0.0.0.0",
                "CONVEYOR_INFERENCE__PORT": str(self.port)}


def address_towards(redis_url: str) -> str:
    """This host's address on the route to the first Redis of ``redis_url`` (no packet is sent)."""
    first = urlsplit(redis_url.split(",")[0])
    host, port = first.hostname or "127.0.0.1", first.port or 6379
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            return probe.getsockname()[0]
    except OSError as exc:
        raise errors.CommandError(f"a server of the run's own: cannot find this host's address towards Redis at {host}:{port} "
                                  f"({exc}); name it with --inference-host") from None


def wait_ready(server: ManagedProcess, own: OwnInference, settings: Settings, say: Callable[[str], None]) -> None:
    """Until the run's server answers; ``ServerNotUp`` with its log's tail if it exits or times out."""
    from services.inference.server import check_inference

    run_id, started = settings.run_id, time.monotonic()
    said_at = started
    while True:
        health = check_inference(own.base_url, timeout=2.0)
        if health["ok"]:
            say(f"run {run_id}: its inference server {own.base_url} is up after {time.monotonic() - started:.0f}s "
                f"({health['detail']})")
            return
        if not server.alive():
            raise ServerNotUp(f"run {run_id}: its inference server exited with {server.proc.returncode} before it "
                                      f"was up; the last lines of {server.log_path}:\n{log_tail(server.log_path)}")
        waited = time.monotonic() - started
        if waited > settings.inference.startup_timeout_s:
            raise ServerNotUp(f"run {run_id}: its inference server at {own.base_url} was not up after "
                                      f"{waited:.0f}s (inference.startup_timeout_s); the last lines of "
                                      f"{server.log_path}:\n{log_tail(server.log_path)}")
        if time.monotonic() - said_at >= PROGRESS_EVERY_S:
            say(f"run {run_id}: waiting for its inference server at {own.base_url} to start ({waited:.0f}s; "
                f"{health['detail']}); intake starts once it is up")
            said_at = time.monotonic()
        time.sleep(POLL_S)
