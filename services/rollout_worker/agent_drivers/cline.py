"""Cline as an ``agent_coding`` agent: ``python3 -m agent_drivers.cline`` in the workspace.

Starts cline-host and cline-core on loopback, points Cline's OpenAI-compatible provider at
``$OPENAI_BASE_URL`` with ``$OPENAI_API_KEY`` (the trajectory's proxy session) and
``$OPENAI_MODEL``, runs the task in ``$AGENT_TASK_FILE`` (``cline_task``), stops everything, and
leaves in ``$AGENT_ARTIFACTS_DIR`` (default ``/tmp/agent-artifacts``):

- ``api_conversation_history.json`` and ``ui_messages.json``: Cline's own record of the task;
- ``metrics.json``: ``prepare_s`` (driver start to Cline configured), ``boot_ok``, ``boot_s``,
  ``settings`` (what Cline reports in force after configuration: mode, telemetry, yolo, welcome
  and announcement seen, auto-approved actions),
  ``outcome`` (``completed``, ``failed``, ``timeout``, ``unanswerable_ask``, ``boot_failed``,
  ``stopped``), the task's figures and how the processes ended (``left_running`` must be 0).

Invariants:
- The task's deadline is ``--timeout`` seconds, by default ``$AGENT_TIMEOUT_S`` less a reserve
  for cancelling, stopping and saving; at the deadline the task is cancelled (``cancelTask``).
- On SIGTERM (the sandbox wrapper stopping the agent) the artifacts and metrics are saved first,
  then the processes are stopped: the wrapper's SIGKILL follows 2 s later.
- Exit code 0 when the task completed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from .cline_processes import ClineLayout, ClineProcesses
from .cline_task import ProviderSettings, TaskRun, configure, run_task
from .protobus import ProtoBus

ARTIFACTS = ("api_conversation_history.json", "ui_messages.json")
STOP_RESERVE_S = 12.0  # cancel, stop core and host, copy the artifacts
BOOT_TIMEOUT_S = 90.0


class Stopped(Exception):
    """SIGTERM arrived."""


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python3 -m agent_drivers.cline", description=__doc__.split("\n\n")[0])
    budget = float(os.environ.get("AGENT_TIMEOUT_S", "600"))
    parser.add_argument("--timeout", type=float, default=max(5.0, budget - STOP_RESERVE_S),
                        help="seconds the task may run before it is cancelled")
    parser.add_argument("--artifacts", type=Path, default=Path(os.environ.get("AGENT_ARTIFACTS_DIR", "/tmp/agent-artifacts")))
    parser.add_argument("--state-dir", type=Path, default=Path("/tmp/cline"))
    parser.add_argument("--package", type=Path, default=Path(os.environ.get("CLINE_PACKAGE", "/opt/agent-npm/node_modules/cline")))
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--context-window", type=int, default=128000)
    parser.add_argument("--max-mistakes", type=int, default=3, help="Cline's max_consecutive_mistakes")
    return parser.parse_args()


def main() -> int:
    started = time.monotonic()
    args = _arguments()
    signal.signal(signal.SIGTERM, _raise_stopped)
    args.artifacts.mkdir(parents=True, exist_ok=True)
    layout = ClineLayout(args.package, args.state_dir)
    processes = ClineProcesses(layout, Path.cwd())
    metrics: dict = {"boot_ok": False, "outcome": "boot_failed"}
    run = TaskRun()
    bus = None
    try:
        processes.start()
        bus = _boot(processes, started + BOOT_TIMEOUT_S)
        metrics.update(boot_ok=True, boot_s=round(time.monotonic() - started, 3),
                       core_port=processes.core_port, host_port=processes.host_port)
        metrics["settings"] = configure(bus, ProviderSettings(
            os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"], os.environ["OPENAI_MODEL"],
            args.max_tokens, args.context_window, args.max_mistakes))
        metrics["prepare_s"] = round(time.monotonic() - started, 3)
        task = Path(os.environ["AGENT_TASK_FILE"]).read_text()
        run_task(bus, task, time.monotonic() + args.timeout, run)
        metrics.update(run.metrics())
    except Stopped:
        metrics.update(run.metrics(), outcome="stopped")
    except Exception as exc:  # the metrics say what went wrong; the episode is graded anyway
        metrics.update(run.metrics(), error=f"{type(exc).__name__}: {exc}")
        metrics["outcome"] = run.outcome or ("failed" if metrics["boot_ok"] else "boot_failed")
        print(f"cline driver: {metrics['error']}", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # finish saving; the wrapper's SIGKILL still ends us
        _save(layout, run.task_id, args.artifacts, metrics)
        if bus is not None:
            bus.close()
        metrics.update(processes.stop())
        metrics["driver_s"] = round(time.monotonic() - started, 3)
        _save(layout, run.task_id, args.artifacts, metrics)
    print(json.dumps({k: v for k, v in metrics.items() if k != "detail"}))
    return 0 if metrics["outcome"] == "completed" else 1


def _boot(processes: ClineProcesses, deadline: float) -> ProtoBus:
    bus = ProtoBus(processes.core_address, processes.layout.descriptor_set)
    while True:
        if (dead := processes.dead()) is not None:
            raise RuntimeError(dead)
        if time.monotonic() > deadline:
            raise TimeoutError(f"cline-core did not answer on {processes.core_address} within {BOOT_TIMEOUT_S:g} s")
        try:
            bus.wait_ready(timeout_s=0.5)
            bus.call("cline.StateService", "getLatestState", timeout_s=10)
            return bus
        except Exception:  # not listening yet (FutureTimeoutError) or not serving yet (RpcError)
            continue


def _save(layout: ClineLayout, task_id: str, artifacts: Path, metrics: dict) -> None:
    if task_id:
        for name in ARTIFACTS:
            source = layout.task_dir(task_id) / name
            if source.is_file():
                shutil.copyfile(source, artifacts / name)
    (artifacts / "metrics.json").write_text(json.dumps(metrics, indent=1))


def _raise_stopped(signum: int, frame: object) -> None:
    raise Stopped


if __name__ == "__main__":
    sys.exit(main())
