"""``conveyor inspect`` and ``conveyor replay``: one trajectory, by its id.

Invariants:
- Both read through ``shared.trajectory_lookup`` with the services' own storage and key
  modules: only the trajectory's own objects, never a scan of the run.
- ``inspect`` renders in the terminal (a pager when stdout is a terminal), or ``--json``
  prints the trajectory, its score, its ledger state and failure as one JSON object.
- ``replay`` exits 0 when the environment answered every recorded action as recorded, 1 at
  the first difference (printed), 2 when the trajectory cannot be found or replayed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from services.cli import errors
from shared.settings import Settings, load_settings
from shared.trajectory_lookup import FoundTrajectory, TrajectoryNotFound, find_trajectory

ConfigOption = typer.Option(None, "--config", "-c", help="YAML settings file (or set CONVEYOR_CONFIG)")
stdout = Console()


def _find(settings: Settings, trajectory_id: str) -> FoundTrajectory:
    from shared.redis_clients import redis_for
    from shared.storage import open_store

    try:
        return find_trajectory(open_store(settings.storage, settings.outage), trajectory_id,
                               redis_for(settings.redis.url, settings.outage))
    except TrajectoryNotFound as exc:
        raise errors.CommandError(str(exc)) from None


def _settings(config: Optional[Path]) -> Settings:
    settings = load_settings(config)
    errors.state.settings = settings
    return settings


def as_json(found: FoundTrajectory) -> dict[str, Any]:
    return {"key": found.key, "state": found.state, "failure": found.failure,
            "trajectory": found.trajectory.model_dump(mode="json"),
            "scored": found.scored.model_dump(mode="json") if found.scored else None}


def _token_line(ids: list[int], mask: list[int], logprobs: list[float], decode) -> Text:  # noqa: ANN001
    """Each token, dim where the loss mask is 0, coloured by its logprob where it is 1."""
    text = Text()
    for token_id, m, logprob in zip(ids, mask, logprobs):
        piece = decode(token_id)
        if not m:
            text.append(piece, style="dim")
        else:
            style = "green" if logprob > -0.5 else "yellow" if logprob > -2.5 else "red"
            text.append(piece, style=f"underline {style}")
    return text


def render(found: FoundTrajectory, decode=None) -> Group:  # noqa: ANN001
    """Header, prompt, then each turn; with ``decode`` (token id -> text), a token view per turn."""
    t, scored = found.trajectory, found.scored
    task = t.request.task
    head = Table.grid(padding=(0, 2))
    for name, value in (
        ("trajectory", t.trajectory_id), ("run / group", f"{t.request.run_id} / {t.request.group_id}"),
        ("environment", task.env_name), ("task", f"{task.task_id}  {task.source}"), ("dataset", task.dataset_version or "-"),
        ("ledger", f"{found.state or '-'}" + (f"  {found.failure}" if found.failure else "")),
        ("stop reason", t.stop_reason.value + (f"  {t.error}" if t.error else "")),
        ("reward", "-" if scored is None else f"{scored.reward:.4g}  " + ", ".join(
            f"{c.name} {c.value:.3g}×{c.weight:g}" for c in scored.components)),
        ("attempt / worker", f"{t.attempt} / {t.worker or '-'}"),
        ("timings", f"episode {t.timings.episode_s:.2f}s, inference {t.timings.inference_s:.2f}s, env {t.timings.env_s:.2f}s"),
        ("object", found.key),
    ):
        head.add_row(Text(name, style="bold"), Text(str(value)))
    parts: list[Any] = [Panel(head, title="trajectory")]
    for message in t.prompt_messages:
        parts.append(Panel(Text(message["content"]), title=f"prompt: {message['role']}", border_style="blue"))
    for turn in t.turns:
        body: list[Any] = [Text(turn.completion_text)]
        for call in turn.tool_calls:
            body.append(Text(f"tool call {call.name}({json.dumps(call.arguments)})", style="magenta"))
        if turn.tool_call_error:
            body.append(Text(f"malformed tool call: {turn.tool_call_error}", style="red"))
        if decode is not None:
            ids = turn.prompt_token_ids + turn.sampled_token_ids
            mask = [0] * len(turn.prompt_token_ids) + [1] * len(turn.sampled_token_ids)
            body.append(Text("tokens: ", style="bold") + _token_line(ids, mask, [0.0] * len(turn.prompt_token_ids) + turn.logprobs, decode))
        title = (f"turn {turn.index}: policy v{turn.policy_version}, {len(turn.sampled_token_ids)} tokens, "
                 f"finish {turn.finish_reason}, reward {turn.reward:g}" + (", new segment" if turn.segment_start else ""))
        parts.append(Panel(Group(*body), title=title, border_style="green"))
        if turn.observation is not None:
            parts.append(Panel(Text(turn.observation), title=f"observation ({t.observation_role})", border_style="yellow"))
    if t.env_info:
        parts.append(Panel(Text(json.dumps(t.env_info, indent=1)[:4000]), title="environment info (verifier, diff, tests)"))
    return Group(*parts)


def _decoder(settings: Settings):  # noqa: ANN202
    from services.viewer.app import tokenizer_decode

    decode = tokenizer_decode(str(settings.inference.model_path))
    if decode is None:
        raise errors.CommandError(f"--tokens needs the policy's tokenizer at inference.model_path "
                                  f"({settings.inference.model_path})")
    return decode


def inspect_command(
    trajectory_id: str = typer.Argument(..., help="a trajectory id: run_group_episode_seed"),
    json_out: bool = typer.Option(False, "--json", help="the trajectory, its score and ledger state as JSON"),
    tokens: bool = typer.Option(False, "--tokens", help="a token view per turn: loss mask and logprobs"),
    config: Optional[Path] = ConfigOption,
) -> None:
    """Show one trajectory: prompt, model output, tool calls, observations, reward, stop reason."""
    settings = _settings(config)
    found = _find(settings, trajectory_id)
    if json_out:
        print(json.dumps(as_json(found)))
        return
    view = render(found, _decoder(settings) if tokens else None)
    if sys.stdout.isatty():
        with stdout.pager(styles=True):
            stdout.print(view)
    else:
        stdout.print(view)


def replay_command(
    trajectory_id: str = typer.Argument(..., help="a trajectory id: run_group_episode_seed"),
    json_out: bool = typer.Option(False, "--json", help="the report as JSON"),
    config: Optional[Path] = ConfigOption,
) -> None:
    """Feed a trajectory's recorded actions to a fresh environment; report the first turn whose
    observation (or reward) differs from the recorded one."""
    from services.rollout_worker.replay import CannotReplay, replay
    from shared.environments import registry_for

    settings = _settings(config)
    found = _find(settings, trajectory_id)
    task = found.trajectory.request.task
    env = registry_for(settings.environments).make(task.env_name, task.env_config)
    try:
        report = asyncio.run(replay(found.trajectory, env))
    except CannotReplay as exc:
        raise errors.CommandError(f"cannot replay {trajectory_id}: {exc}") from None
    if json_out:
        print(json.dumps(report.as_dict()))
    elif report.divergence is None:  # report.matches
        stdout.print(f"replay of {trajectory_id}: {report.turns_replayed} turns, every observation as recorded"
                     + ("" if report.verifier_reward is None else f"; verifier {report.verifier_reward:g}"))
    else:
        d = report.divergence
        stdout.print(f"[red]replay of {trajectory_id} diverges at turn {d.turn} ({d.what})[/red]")
        stdout.print(Panel(Text(str(d.recorded)), title="recorded"))
        stdout.print(Panel(Text(str(d.replayed)), title="replayed"))
    for note in report.notes:
        stdout.print(f"note: {note}")
    raise typer.Exit(0 if report.matches else 1)
