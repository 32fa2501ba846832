"""Replay: a recorded trajectory's actions fed to a fresh environment (a fresh sandbox, for the
sandboxed ones), reporting the first place where the environment answers differently.

Invariants:
- The environment is made exactly as the rollout worker makes it (the registry, the task's
  ``env_config``) and reset with the recorded task and task seed; the recorded prompt
  messages are compared with what ``reset`` gives (turn -1 in the report).
- Each turn's action is the recorded model output parsed as the episode loop parses it;
  the observation and the per-turn reward it gets back are compared with the recorded ones.
  The first difference ends the replay; then, or after the last turn, the verifier runs and
  its reward is compared with the recorded one.
- The environment is closed however the replay ends. Agent-driven environments (the agent
  acts, not the model's text) and multi-episode trials are refused with the reason.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from services.rollout_worker.tool_calls import parse_tool_calls
from shared.environments import AgentAction, AgentDrivenEnvironment, Environment
from shared.schemas import Trajectory


class CannotReplay(Exception):
    pass


@dataclass
class Divergence:
    turn: int  # -1: the reset's prompt
    what: str  # "prompt", "observation", "reward", "done", "verifier"
    recorded: Any
    replayed: Any


@dataclass
class ReplayReport:
    trajectory_id: str
    env_name: str
    turns_replayed: int
    divergence: Divergence | None = None
    verifier_reward: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def matches(self) -> bool:
        return self.divergence is None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"matches": self.matches}


async def replay(trajectory: Trajectory, env: Environment) -> ReplayReport:
    if isinstance(env, AgentDrivenEnvironment):
        raise CannotReplay(f"{trajectory.request.task.env_name} is agent-driven: its agent acts, not the model's text")
    if env.config.episodes_per_trial > 1:
        raise CannotReplay("trials of several episodes are not replayed yet")
    task = trajectory.request.task
    report = ReplayReport(trajectory.trajectory_id, task.env_name, 0)
    try:
        messages = await env.reset(task.task_data, trajectory.request.task_seed)
        if trajectory.prompt_messages and messages != trajectory.prompt_messages:
            report.divergence = Divergence(-1, "prompt", trajectory.prompt_messages, messages)
            return report
        for turn in trajectory.turns:
            calls, call_error = parse_tool_calls(turn.completion_text)
            result = await env.step(AgentAction(turn.completion_text, calls, call_error))
            report.turns_replayed += 1
            observation = None if result.done else result.observation
            for what, recorded, replayed in (("observation", turn.observation, observation),
                                             ("reward", turn.reward, result.reward)):
                if recorded != replayed:
                    report.divergence = Divergence(turn.index, what, recorded, replayed)
                    return report
            if result.done and turn is not trajectory.turns[-1]:
                report.divergence = Divergence(turn.index, "done", False, True)
                return report
        verdict = await env.verify()
        report.verifier_reward = verdict.reward
        if trajectory.env_reward is not None and verdict.reward != trajectory.env_reward:
            report.divergence = Divergence(len(trajectory.turns), "verifier", trajectory.env_reward, verdict.reward)
        if trajectory.stop_reason.value in ("env_error", "infra_error"):
            report.notes.append(f"the recorded episode ended with {trajectory.stop_reason.value}: {trajectory.error}")
        return report
    finally:
        await env.close()
