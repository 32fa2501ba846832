"""``conveyor demo``: the whole pipeline as local processes, on a small generated dataset.

Starts Redis (with AOF), the filesystem object store, vLLM on CPU with a generated tiny model, a rollout worker,
a scoring worker and the trainer; runs intake; shows progress until every trajectory is
terminal; prints a summary; stops everything, also on Ctrl-C, SIGTERM or failure.

Invariant: no process of the demo outlives it. Every child runs in its own process group and
is stopped (SIGTERM, then SIGKILL) on the way out, whatever ended the demo; SIGTERM and
Ctrl-C end it the same way (``shared.processes``), and a demo killed with SIGKILL takes its
children with it (``die_with_parent``).
"""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from services.cli.local_stack import LocalStack, free_port
from shared.processes import Terminated
from shared.state.ledger import STATES, LedgerReads
from shared.state.trainer_counters import TrainerCounters

console = Console()
DEMO_REWARD_WEIGHTS = {"verifier": 1.0, "format": 0.1, "brevity": 0.1}
# the learning demo's toy task: a single turn whose reward is the share of digits in the reply
TOY_REWARD_FN = "services.rollout_worker.environments.toy_rewards:digit_share"
DIGITS_ENVIRONMENT = {"env_name": "single_turn", "env_config": {"reward_fn": TOY_REWARD_FN}}


def write_demo_dataset(path: Path, tasks: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for index in range(tasks):
            fh.write(json.dumps({"id": f"guess-{index}", "task_data": {"low": 1, "high": 20, "target": rng.randint(1, 20)}}) + "\n")
    return path


def write_prompts(path: Path, n: int = 16) -> Path:
    """The toy task's prompts (``TOY_REWARD_FN`` scores the replies)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"p{i}", "prompt": f"Write some numbers, please ({i})."}) + "\n")
    return path


def demo_dataset(kind: str, tasks: int, directory: Path) -> tuple[Path, dict]:
    """``conveyor intake --demo KIND --demo-tasks N``: the dataset, and the ``intake`` settings
    it needs. ``guess``: guess-the-number tasks (multi-turn; the intake's own environment
    settings). ``digits``: the toy task's prompts, in the ``single_turn`` environment scored by
    ``TOY_REWARD_FN``, which the tiny model learns within a few steps (docs/learning.md)."""
    if kind == "guess":
        return write_demo_dataset(directory / "guess.jsonl", tasks), {}
    if kind == "digits":
        return write_prompts(directory / "prompts.jsonl", tasks), DIGITS_ENVIRONMENT
    raise ValueError(f"--demo must be 'guess' or 'digits', got {kind!r}")


def run_demo(config: Path | None, tasks: int, workdir: Path, timeout_s: float = 1200) -> int:
    from services.inference.server import VllmServer
    from services.inference.tiny_model import generate_tiny_model

    workdir = Path(workdir).resolve()
    run_id = f"demo-{int(time.time())}"
    stack = LocalStack(workdir, run_id=run_id)
    if config:
        stack.env["CONVEYOR_CONFIG"] = str(Path(config).resolve())
    else:  # the random tiny model never solves the game; brevity makes rewards differ in a group
        stack.env["CONVEYOR_REWARDS__WEIGHTS"] = json.dumps(DEMO_REWARD_WEIGHTS)
    vllm = None
    try:
        with console.status("starting Redis (with its append-only file) and the object store"):
            stack.start_redis()
            stack.start_object_store()  # durable: a directory under the workdir
        with console.status("generating the tiny model"):
            model_dir = generate_tiny_model(workdir / "models" / "tiny", end_of_turn_bias=4.0)
        port = free_port()
        # eager: the demo decodes little, and eager vLLM starts in a third of the time
        vllm = VllmServer(model_dir, "tiny", port=port, log_path=workdir / "logs" / "vllm.log", eager=True)
        with console.status("starting vLLM on CPU (eager: about half a minute)"):
            vllm.start()
            ready_s = vllm.wait_ready(600, report_every_s=15)
        console.print(f"vLLM ready in {ready_s:.0f}s at {vllm.base_url}")
        stack.use_inference(vllm.base_url, model_dir, "tiny")
        stack.start_rollout_worker()
        stack.start_scoring_worker()
        stack.start_trainer()
        dataset = write_demo_dataset(workdir / "data" / "guess.jsonl", tasks)
        result = stack.run_conveyor("intake", "--dataset", str(dataset))
        console.print(result.stderr.strip() or result.stdout.strip())
        if result.returncode != 0:
            return result.returncode
        _follow(stack, run_id, timeout_s)
        _summary(stack, run_id)
        _show_groups_and_an_episode(stack, run_id)
        return 0
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: shutting down[/yellow]")
        return 130
    except Terminated:
        console.print("[yellow]terminated (SIGTERM): shutting down[/yellow]")
        return 128 + signal.SIGTERM
    finally:
        with console.status("stopping everything"):
            stack.stop()
            if vllm:
                vllm.stop()
        console.print(f"logs and metrics: {workdir}")


def _follow(stack: LocalStack, run_id: str, timeout_s: float) -> None:
    ledger = LedgerReads(stack.redis_client())
    deadline = time.time() + timeout_s
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), console=console) as progress:
        bar = progress.add_task("trajectories consumed or failed", total=None)
        while time.time() < deadline:
            counts = ledger.counts(run_id)
            total = sum(counts.values())
            done = counts["consumed"] + counts["failed"]
            progress.update(bar, total=total, completed=done, description=" ".join(f"{s}={counts[s]}" for s in STATES))
            if total and done == total:
                return
            for proc in stack.processes:
                if not proc.alive():
                    raise RuntimeError(f"{proc.name} died:\n{stack.logs(proc.name)}")
            time.sleep(0.5)
    raise TimeoutError(f"the demo did not finish within {timeout_s}s")


def _summary(stack: LocalStack, run_id: str) -> None:
    client = stack.redis_client()
    counts = LedgerReads(client).counts(run_id)
    trainer = TrainerCounters(client, run_id).all()
    metrics_path = Path(stack.env["CONVEYOR_TRAINER__METRICS_PATH"])
    groups = [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
    table = Table(title=f"Conveyor demo {run_id}")
    table.add_column("what")
    table.add_column("value", justify="right")
    for state in STATES:
        table.add_row(f"trajectories {state}", str(counts[state]))
    for name, value in sorted(trainer.items()):
        table.add_row(f"trainer {name}", str(value))
    rewards = [g["reward_mean"] for g in groups if g.get("reward_mean") is not None]
    if rewards:
        table.add_row("mean group reward", f"{sum(rewards) / len(rewards):.3f}")
    latencies = sorted(g["group_latency_s"] for g in groups)
    if latencies:
        table.add_row("group latency p50 (s)", f"{latencies[len(latencies) // 2]:.2f}")
    console.print(table)


def _show_groups_and_an_episode(stack: LocalStack, run_id: str) -> None:
    from shared.inline_trajectories import read_trajectory
    from shared.schemas import GroupRecord, ScoredTrajectory
    from shared.settings import load_settings
    from shared.storage import get_model, get_models_under, open_store

    import os

    os.environ.update(stack.env)
    store = open_store(load_settings().storage)
    table = Table(title="GRPO groups: rewards and advantages")
    for column in ("group", "status", "rewards", "advantages"):
        table.add_column(column)
    records = [get_model(store, key, GroupRecord) for key in store.list_keys(f"groups/{run_id}/")]
    for record in records:
        members = [m for m in record.members if m.reward is not None]
        table.add_row(
            str(record.group_id), record.status,
            " ".join(f"{m.reward:+.3f}" for m in members),
            " ".join(f"{m.advantage:+.2f}" for m in members),
        )
    console.print(table)
    if not records or not records[0].members:
        return
    first = records[0].members[0]
    scored = next(s for s in get_models_under(store, f"scored/{run_id}/", ScoredTrajectory) if s.trajectory_id == first.trajectory_id)
    trajectory = read_trajectory(store, stack.redis_client(), scored.trajectory_key)
    console.print(f"episode {trajectory.trajectory_id}: {len(trajectory.turns)} turns, stop reason {trajectory.stop_reason.value}")
    for turn in trajectory.turns:
        said = turn.completion_text.replace("\n", " ")[:60]
        console.print(
            f"  turn {turn.index}: +{len(turn.prompt_token_ids)} prompt ids, {len(turn.sampled_token_ids)} sampled ids "
            f"({turn.finish_reason}); model: {said!r}; env: {(turn.observation or '')[:50]!r}"
        )
