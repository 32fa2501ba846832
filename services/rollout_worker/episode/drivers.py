"""How an episode is driven: the token loop, or the environment's own agent.

Invariants:
- ``driver_for`` is the one place that picks: an ``AgentDrivenEnvironment`` goes to the agent
  driver (``agents.episode``), every other environment to the token loop (``episode.loop``). The
  capability is declared (``shared.environments.protocol``), never probed.
- A ``SandboxedEnvironment`` is bound to its trajectory before ``reset``, so every container it
  makes carries the trajectory's labels (the janitor's); the token loop binds the environment
  itself, not the main-thread wrapper around it (``environments.main_thread``).
- Each driver attaches its trajectory's artifacts: once the episode ended without ``env_error``
  (an env_error trajectory is failed, never uploaded), an ``ArtifactWriter`` environment writes
  them from the trajectory's ``env_info``, off the event loop. The runner knows no environment's
  artifacts.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol

from services.rollout_worker.agents.episode import run_agent_episode
from services.rollout_worker.agents.proxy import AgentProxy
from services.rollout_worker.chat_tokens import ChatTokens
from services.rollout_worker.environments.main_thread import on_main_thread
from services.rollout_worker.episode.loop import EpisodeLimits, run_episode
from services.rollout_worker.inference_client import InferenceClient
from services.rollout_worker.inference_targets import Served
from shared.environments import AgentDrivenEnvironment, ArtifactWriter, Environment, SandboxedEnvironment
from shared.schemas import RolloutRequest, StopReason, Trajectory
from shared.storage import ObjectStore


class EpisodeDriver(Protocol):
    """Runs one episode of ``env`` for ``request`` and returns its trajectory, artifacts attached."""

    async def run(self, request: RolloutRequest, env: Environment, limits: EpisodeLimits,
                  policy_version: Callable[[], int], attempt: int, worker: str) -> Trajectory: ...


@dataclass(frozen=True)
class TokenLoopDriver:
    """The model samples every turn, token in, token out (``episode.loop.run_episode``)."""

    inference: InferenceClient
    chat: ChatTokens
    store: ObjectStore | None = None

    async def run(self, request: RolloutRequest, env: Environment, limits: EpisodeLimits,
                  policy_version: Callable[[], int], attempt: int, worker: str) -> Trajectory:
        if isinstance(env, SandboxedEnvironment):
            env.bind_trajectory(run_id=request.run_id, group_id=request.group_id, trajectory_id=request.trajectory_id)
        trajectory = await run_episode(request, on_main_thread(env), self.inference, self.chat, limits,
                                       policy_version=policy_version, attempt=attempt, worker=worker)
        return await attach_artifacts(env, trajectory, self.store)


@dataclass(frozen=True)
class AgentDriver:
    """The environment's agent makes the model calls through the recording proxy (``agents.episode``)."""

    proxy: Callable[[], Awaitable[AgentProxy]]  # the process's proxy, started on first use
    store: ObjectStore | None = None
    server: Served | None = None  # the inference server the agent's calls go to; None: the proxy's

    async def run(self, request: RolloutRequest, env: Environment, limits: EpisodeLimits,
                  policy_version: Callable[[], int], attempt: int, worker: str) -> Trajectory:
        if not isinstance(env, AgentDrivenEnvironment):
            raise TypeError(f"environment {env.name!r} is not agent-driven (driver_for picks the token loop for it)")
        trajectory = await run_agent_episode(request, env, await self.proxy(), limits, policy_version=policy_version,
                                             attempt=attempt, worker=worker, store=self.store, server=self.server)
        return await attach_artifacts(env, trajectory, self.store)


def driver_for(env: Environment, token_loop: EpisodeDriver, agent: EpisodeDriver) -> EpisodeDriver:
    """The one choice of driver: by the environment's declared capability."""
    return agent if isinstance(env, AgentDrivenEnvironment) else token_loop


async def attach_artifacts(env: Environment, trajectory: Trajectory, store: ObjectStore | None) -> Trajectory:
    """Writes the trajectory's artifacts when ``env`` is an ``ArtifactWriter``, the episode did not
    end with ``env_error`` and there is a store to write to."""
    if store is not None and isinstance(env, ArtifactWriter) and trajectory.stop_reason is not StopReason.env_error:
        await asyncio.to_thread(env.write_artifacts, store, trajectory.request.run_id, trajectory.trajectory_id,
                                trajectory.env_info)
    return trajectory
