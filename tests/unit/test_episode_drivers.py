"""Declared capabilities pick the episode driver and attach artifacts
(``services.rollout_worker.episode.drivers``, ``shared.environments.protocol``): the checks are
structural, so a plugin that merely defines the methods is recognised as a built-in subclass is.
"""

from __future__ import annotations

import asyncio
import time

from services.rollout_worker.environments.agent_coding import AgentCodingEnv
from services.rollout_worker.environments.coding import CodingEnv
from services.rollout_worker.environments.guess_number import GuessNumberEnv
from services.rollout_worker.environments.main_thread import on_main_thread
from services.rollout_worker.episode.drivers import AgentDriver, TokenLoopDriver, attach_artifacts, driver_for
from shared.environments import AgentDrivenEnvironment, ArtifactWriter, SandboxedEnvironment, StepResult, VerifyResult
from shared.schemas import RolloutRequest, StopReason, TaskProfile, Trajectory


class PluginAgentEnv(GuessNumberEnv):
    """A third-party agent-driven environment: it defines the methods, subclasses no protocol."""

    def bind_trajectory(self, *, run_id, group_id, trajectory_id):  # noqa: ANN001, ANN201
        self.bound = trajectory_id

    def attach_agent(self, endpoint):  # noqa: ANN001, ANN201
        self.endpoint = endpoint

    async def run_agent(self):  # noqa: ANN201
        return None


class WritesNotes(GuessNumberEnv):
    """A plugin that writes one artifact from its info."""

    def write_artifacts(self, store, run_id, trajectory_id, info):  # noqa: ANN001, ANN201
        key = f"artifacts/{run_id}/{trajectory_id}/notes.txt"
        store.put_bytes(key, str(info["notes"]).encode(), content_type="text/plain")
        return {"notes.txt": key}

    async def step(self, action):  # noqa: ANN001, ANN201
        return StepResult("", done=True)

    async def verify(self):  # noqa: ANN201
        return VerifyResult(0.0, {"notes": "kept"})


def test_capabilities_are_declared_by_the_built_ins_and_recognised_in_plugins():
    coding, agent_coding = CodingEnv(), AgentCodingEnv({"agent_command": "true"})
    assert isinstance(coding, SandboxedEnvironment) and isinstance(coding, ArtifactWriter)
    assert not isinstance(coding, AgentDrivenEnvironment)
    assert isinstance(agent_coding, AgentDrivenEnvironment) and isinstance(agent_coding, ArtifactWriter)
    assert isinstance(PluginAgentEnv(), AgentDrivenEnvironment)
    plain = GuessNumberEnv()
    assert not any(isinstance(plain, c) for c in (SandboxedEnvironment, AgentDrivenEnvironment, ArtifactWriter))
    # the main-thread wrapper is no sandbox of its own: the token loop binds what it wraps
    assert not isinstance(on_main_thread(coding), SandboxedEnvironment)


def test_driver_for_picks_the_agent_driver_for_agent_driven_environments_only():
    token_loop, agent = TokenLoopDriver(None, None), AgentDriver(lambda: None)  # type: ignore[arg-type]
    assert driver_for(PluginAgentEnv(), token_loop, agent) is agent
    assert driver_for(AgentCodingEnv({"agent_command": "true"}), token_loop, agent) is agent
    assert driver_for(CodingEnv(), token_loop, agent) is token_loop
    assert driver_for(GuessNumberEnv(), token_loop, agent) is token_loop


def _trajectory(stop: StopReason, info: dict) -> Trajectory:
    task = TaskProfile(task_id="t0", env_name="guess_number", task_data={})
    request = RolloutRequest(run_id="drivers", group_id=0, episode_index=0, episode_seed=1, trajectory_id="drivers_0_0_1",
                             group_size=1, task=task, dispatched_at=time.time())
    return Trajectory(request=request, turns=[], stop_reason=stop, env_info=info)


def test_artifacts_are_attached_for_a_finished_episode_and_not_for_an_env_error(store):
    asyncio.run(attach_artifacts(WritesNotes(), _trajectory(StopReason.done, {"notes": "kept"}), store))
    assert store.get_bytes("artifacts/drivers/drivers_0_0_1/notes.txt") == b"kept"
    asyncio.run(attach_artifacts(WritesNotes(), _trajectory(StopReason.env_error, {"notes": "broken"}), store))
    assert store.get_bytes("artifacts/drivers/drivers_0_0_1/notes.txt") == b"kept"
    asyncio.run(attach_artifacts(GuessNumberEnv(), _trajectory(StopReason.done, {"notes": "x"}), store))  # no writer


def test_the_coding_environment_writes_nothing_when_verify_never_ran(store):
    assert CodingEnv().write_artifacts(store, "drivers", "drivers_0_0_1", {}) == {}
    keys = CodingEnv().write_artifacts(store, "drivers", "drivers_0_0_1", {"diff": "+x\n"})
    assert store.get_bytes(keys["diff.patch"]) == b"+x\n"
