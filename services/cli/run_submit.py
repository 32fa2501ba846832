"""``conveyor run submit CONFIG``: one run started on a running stack, beside the runs already on it.

The shared stack (Redis, the object store, the rollout and scoring workers, vLLM) stays up; a
submitted run adds its own processes: its trainer, its weight follower (which restores and
probes the run's base weights on the served model before following its checkpoints:
``WeightFollower.ensure_base``) and its intake.

Invariants:
- Nothing is started and nothing is written before every check passed: the settings, the
  environment plugins, the model, every row of the dataset (a bad row is one error naming the
  file, the row and the field: exit 2) and the run id, new unless ``--resume``
  (``runs.refuse_run_in_use``: the same check intake makes).
- The run's processes are children of one supervisor, each in its own process group with its log
  at ``<runs_dir>/<run id>/logs/<process>.log`` (``LocalStack.spawn``); the supervisor ends
  them however it ends (done, a failure, Ctrl-C, SIGTERM, or SIGKILL through the process-group guard),
  and never signals a process of the shared stack.
- The run is done when intake and the trainer exited 0: the trainer exits once intake is done
  and every trajectory is consumed or failed, or once the run is stopped (``conveyor run stop``,
  which so ends the supervisor too). The follower is then stopped and the supervisor exits 0. A
  process that exits non-zero, or a follower that exits before the trainer, ends the others, and
  the supervisor exits 1 naming it with the tail of its log.
- With a server of its own (``--inference own``, or ``auto`` when a dry claim on the shared
  servers is refused: ``needs_own_server``) the run's follower is a vLLM of the run's own with its
  weight follower (``own_inference``: every process of the run names it, and intake starts once
  it is up); else the follower attaches to the servers at ``inference.base_url``.
- Runs submitted beside each other share the rollout workers fairly: each run's intake keeps at
  most ``intake.max_queued_groups`` groups waiting in the rollout queue (``SUBMITTED_RUN_QUEUED_GROUPS``
  unless the config sets it; ``services.intake.queue_share``).
- It never waits silently: every ``PROGRESS_EVERY_S`` it says which processes it waits for and
  the run's trajectories by ledger state.
"""

from __future__ import annotations

import enum
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from services.cli import errors
from services.cli.local_stack import LocalStack, ManagedProcess, log_tail
from services.cli.own_inference import OwnInference, ServerNotUp, wait_ready
from services.cli.run_logs import run_logs_dir
from shared.settings import Settings, load_settings

PROGRESS_EVERY_S = 10.0
# a submitted run's share of the rollout queue, in groups, unless its config sets intake.max_queued_groups
SUBMITTED_RUN_QUEUED_GROUPS = 8
WATCH_POLL_S = 0.5
FAILED_LOG_LINES = 30
UNTIL = {"intake": "to publish every group",
         "trainer": "to see intake done and every trajectory consumed or failed (or the run stopped)"}


class InferenceChoice(str, enum.Enum):
    auto = "auto"
    shared = "shared"
    own = "own"


def submit_command(
    config: Path = typer.Argument(..., help="the run's YAML settings file (the --config format of every command)"),
    resume: bool = typer.Option(False, "--resume", help="continue a run id that is already in Redis (without it, a run "
                                "id in use is an error)"),
    detach: bool = typer.Option(False, "--detach", help="supervise the run in the background; print where its logs are"),
    inference: InferenceChoice = typer.Option(InferenceChoice.auto, "--inference", help="the run's vLLM: shared (attach "
                                              "to the servers at inference.base_url), own (launch one of the run's own) "
                                              "or auto: own when a run holds the shared one in a way that would refuse "
                                              "this run (it trains there, or this run trains), else shared"),
    inference_host: Optional[str] = typer.Option(None, "--inference-host", help="for a server of the run's own: the "
                                                 "address the rollout workers reach this host by (default: this host's "
                                                 "address towards Redis)"),
    inference_port: Optional[int] = typer.Option(None, "--inference-port", min=1, max=65535, help="for a server of "
                                                 "the run's own: the port it listens on (default: one free on this "
                                                 "host), for a port published to workers on other hosts"),
) -> None:
    """Start a run on the running stack: check it, then run its trainer, weight follower and intake
    until it is done (Ctrl-C or SIGTERM stops the run's processes, not the stack)."""
    config = config.resolve()
    settings = load_settings(config)
    errors.state.settings = settings
    check_submission(settings, resume)
    if (inference_host is not None or inference_port is not None) and inference is InferenceChoice.shared:
        raise errors.CommandError("--inference-host and --inference-port name the run's own inference server: not with "
                                  "--inference shared")
    flags = [*(["--resume"] if resume else []), "--inference", inference.value,
             *(["--inference-host", inference_host] if inference_host else []),
             *(["--inference-port", str(inference_port)] if inference_port else [])]
    if detach:  # the supervisor chooses
        _detach(config, settings, flags)
        return
    own = (OwnInference.for_settings(settings, inference_host, inference_port)
           if needs_own_server(settings, inference) else None)
    sys.exit(supervise(config, settings, resume, own))


def needs_own_server(settings: Settings, choice: InferenceChoice) -> bool:
    """Whether the run launches a vLLM of its own: asked, or (auto) the shared servers are held
    by a run whose claim would refuse this run's follower (a dry claim: the same rule, nothing held)."""
    from shared.state.ledger import redis_for
    from shared.state.replica_holders import ReplicaHolders

    if choice is not InferenceChoice.auto:
        return choice is InferenceChoice.own
    inference = settings.inference
    replicas = [url.rstrip("/") for url in inference.replica_urls or [inference.base_url]]
    refusal = ReplicaHolders(redis_for(settings.redis.url, settings.outage)).claim(
        replicas, settings.run_id, settings.trainer.mode == "train", str(inference.model_path), dry=True)
    if refusal is None:
        print(f"run {settings.run_id}: on the shared inference server(s) {', '.join(replicas)}", flush=True)
        return False
    print(f"run {settings.run_id}: {refusal.replica} is held: {refusal.why()}; launching an inference server of the "
          f"run's own (--inference shared refuses instead)", flush=True)
    return True


def check_submission(settings: Settings, resume: bool) -> None:
    """Every check ``run submit`` makes before it starts anything; a ``CommandError`` on the first that fails."""
    from services.cli.preflight import check_environments, require_model
    from services.cli.runs import refuse_run_in_use
    from shared.state.ledger import redis_for

    check_environments(settings)
    check_dataset(settings)
    refuse_run_in_use(redis_for(settings.redis.url, settings.outage), settings.run_id, resume)
    require_model(settings)


def check_dataset(settings: Settings) -> int:
    """Every row of ``intake.dataset`` through intake's admission (``services.intake.validation``);
    returns how many rows, or raises naming the first bad one: its file and row, its field, why."""
    from services.intake.datasets import read_dataset
    from services.intake.limits import PromptLimit
    from services.intake.validation import validate
    from shared.environments import registry_for

    intake = settings.intake
    if not intake.dataset:
        raise errors.CommandError("no dataset: set intake.dataset in the run's config file")
    data = read_dataset(intake.dataset, intake.split, intake.dataset_label, intake.max_row_bytes)
    report = validate(data, intake.env_name, intake.env_config, registry_for(settings.environments),
                      PromptLimit.from_settings(settings), intake.splits)
    if report.rejected:
        # fields in the order their first rejection came: the first one holds the first bad row
        field, found = next(iter(report.errors.items()))
        source, reason = found.first[0]
        raise errors.CommandError(
            f"{source}: field {field}: {reason} ({report.rejected} of {report.rows} rows rejected; `conveyor data "
            f"validate {intake.dataset}` lists them); nothing was started")
    return report.rows


def queue_share_env(settings: Settings) -> dict[str, str]:
    """A submitted run shares the workers: its intake gets ``SUBMITTED_RUN_QUEUED_GROUPS`` as
    ``intake.max_queued_groups`` unless the config sets one (``services.intake.queue_share``)."""
    if settings.intake.max_queued_groups is not None:
        return {}
    return {"CONVEYOR_INTAKE__MAX_QUEUED_GROUPS": str(SUBMITTED_RUN_QUEUED_GROUPS)}


def supervise(config: Path, settings: Settings, resume: bool, own: OwnInference | None = None) -> int:
    """Start the run's processes, watch them to the end; the exit code of ``run submit``. With
    ``own``, the follower is a vLLM server of the run's own with its follower (``own_inference``)."""
    from shared.processes import Terminated

    run_id = settings.run_id
    # the configured paths, not LocalStack's defaults under the run's folder
    env = {"CONVEYOR_CONFIG": str(config), "CONVEYOR_TRAINER__METRICS_PATH": str(settings.trainer.metrics_path),
           "CONVEYOR_INFERENCE__WEIGHTS_DIR": str(settings.inference.weights_dir), **(own.env() if own else {})}
    stack = LocalStack(run_logs_dir(settings, run_id).parent, run_id=run_id, env=env)

    def started(process: ManagedProcess) -> None:
        print(f"run {run_id}: started {process.name} (pid {process.proc.pid}), log {process.log_path}", flush=True)

    try:
        started(stack.start_trainer(exit_when_done=True))
        if own is None:
            started(stack.start_weight_follower(name="follower"))
        else:
            server = stack.conveyor("follower", "inference")
            started(server)
            try:
                wait_ready(server, own, settings, lambda line: print(line, flush=True))
            except ServerNotUp as exc:
                print(f"{exc}\nstopping the run's other processes", file=sys.stderr, flush=True)
                return 1
        started(stack.conveyor("intake", "intake", *(["--resume"] if resume else []), extra_env=queue_share_env(settings)))
        return _watch(stack, settings)
    except KeyboardInterrupt:
        print(f"run {run_id}: interrupted; stopping its processes (the stack stays up)", flush=True)
        return 128 + signal.SIGINT
    except Terminated:
        print(f"run {run_id}: terminated (SIGTERM); stopping its processes (the stack stays up)", flush=True)
        return 128 + signal.SIGTERM
    finally:
        stack.stop()


def _watch(stack: LocalStack, settings: Settings) -> int:
    from shared.state.ledger import LedgerReads, redis_for
    from shared.state.run_stop import stop_of

    run_id = settings.run_id
    client = redis_for(settings.redis.url, settings.outage)
    ledger = LedgerReads(client)
    trainer, follower, intake = (stack.process(name) for name in ("trainer", "follower", "intake"))
    said_at = time.monotonic()
    while True:
        failed = next((p for p in (trainer, intake, follower) if p.proc.poll() not in (None, 0)), None)
        if failed is None and not follower.alive() and trainer.alive():
            failed = follower  # exited 0 while the run goes on: nobody would follow its checkpoints
        if failed is not None:
            print(_failure(run_id, failed), file=sys.stderr, flush=True)
            return 1
        if not trainer.alive() and not intake.alive():
            stop = stop_of(client, run_id)
            outcome = "done" if stop is None else stop.describe()
            print(f"run {run_id} {outcome}: {ledger.describe_counts(run_id)}", flush=True)
            return 0
        if time.monotonic() - said_at >= PROGRESS_EVERY_S:
            waiting = "; ".join(f"{p.name} {UNTIL[p.name]}" for p in (intake, trainer) if p.alive())
            print(f"run {run_id}: {ledger.describe_counts(run_id)}; waiting for {waiting}", flush=True)
            said_at = time.monotonic()
        time.sleep(WATCH_POLL_S)


def _failure(run_id: str, process: ManagedProcess) -> str:
    how = f"exited with {process.proc.returncode}" if process.proc.returncode else "exited before the trainer"
    return (f"run {run_id}: {process.name} {how}; stopping the run's other processes. The last lines of "
            f"{process.log_path}:\n{log_tail(process.log_path, FAILED_LOG_LINES)}")


def _detach(config: Path, settings: Settings, flags: list[str]) -> None:
    """The supervisor as a background process of its own session (it outlives this command and
    the terminal), its output in the run's ``supervisor.log``."""
    folder = run_logs_dir(settings, settings.run_id)
    folder.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "services.cli.app", "run", "submit", str(config), *flags]
    with (folder / "supervisor.log").open("ab") as log:
        supervisor = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True, cwd=os.getcwd())
    run_id = settings.run_id
    print(f"run {run_id} submitted: its supervisor is pid {supervisor.pid}, its logs are in {folder}\n"
          f"  conveyor run logs {run_id} --config {config} --follow\n"
          f"  conveyor run stop {run_id} --config {config}")
