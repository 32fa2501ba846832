"""``conveyor inspect`` and ``conveyor replay`` (issue 14, items 2 and 3) on a trajectory recorded
by playing the real guess_number environment: the lookup finds the attempt the scorer was given
without scanning the run; replay against a fresh environment reports no divergence, and an
environment changed on purpose reports its first diverging turn. Real Redis, the filesystem
object store, the real CLI."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from services.rollout_worker.environments.guess_number import GuessNumberEnv
from services.rollout_worker.replay import CannotReplay, replay
from services.rollout_worker.tool_calls import parse_tool_calls
from shared import ids
from shared.environments import AgentAction, StepResult, registry_for
from shared.names import RedisKeys, scored_key, trajectory_key
from shared.schemas import (RewardBreakdown, RolloutRequest, ScoredTrajectory, ScoringTask, StopReason, TaskProfile,
                            Trajectory, Turn)
from shared.storage import LocalStore, put_model
from shared.trajectory_lookup import TrajectoryNotFound, find_trajectory

GUESSES = [50, 25, 37]  # target 37 in [1, 100]: lower, higher, correct


def guess(number: int) -> str:
    return f'Let me try.<tool_call>{{"name": "guess", "arguments": {{"number": {number}}}}}</tool_call>'


async def play(env, request: RolloutRequest) -> Trajectory:  # noqa: ANN001
    """What the episode loop records, for scripted model output (token ids are stand-ins)."""
    messages = await env.reset(request.task.task_data, request.task_seed)
    turns = []
    for index, number in enumerate(GUESSES):
        text = guess(number)
        calls, error = parse_tool_calls(text)
        result: StepResult = await env.step(AgentAction(text, calls, error))
        turns.append(Turn(index=index, prompt_token_ids=[1, 2], sampled_token_ids=[3, 4], logprobs=[-0.1, -3.0],
                          policy_version=2, finish_reason="stop", completion_text=text, tool_calls=calls,
                          observation=None if result.done else result.observation, reward=result.reward))
    verdict = await env.verify()
    await env.close()
    return Trajectory(request=request, turns=turns, stop_reason=StopReason.done, prompt_messages=messages,
                      env_reward=verdict.reward, env_info=verdict.info, attempt=2, worker="w1")


@pytest.fixture
def recorded(tmp_path, redis_client, run_id):
    """Attempt 1 (abandoned) and attempt 2 (the one scored) of one trajectory, in a local store."""
    store = LocalStore(tmp_path / "objects")
    seed = ids.episode_seed(0, 3, 1)
    tid = ids.trajectory_id(run_id, 3, 1, seed)
    task = TaskProfile(task_id="g3", env_name="guess_number", task_data={"low": 1, "high": 100, "target": 37}, source="d.jsonl:4")
    request = RolloutRequest(run_id=run_id, group_id=3, episode_index=1, episode_seed=seed, trajectory_id=tid, members_dispatched=4,
                             task=task, dispatched_at=time.time())
    trajectory = asyncio.run(play(GuessNumberEnv(), request))
    base = trajectory_key(run_id, 3, tid)
    first, second = base.replace(".json.gz", ".a1-0badc0de.json.gz"), base.replace(".json.gz", ".a2-1234abcd.json.gz")
    put_model(store, first, trajectory.model_copy(update={"attempt": 1, "turns": trajectory.turns[:1]}))
    put_model(store, second, trajectory)
    put_model(store, scored_key(run_id, 3, tid), ScoredTrajectory(
        trajectory_id=tid, run_id=run_id, group_id=3, trajectory_key=second, reward=1.0, stop_reason=StopReason.done,
        components=[RewardBreakdown(name="verifier", value=1.0, weight=1.0)], scored_at=time.time()))
    redis_client.hset(RedisKeys.states(run_id), tid, "consumed")
    redis_client.hset(RedisKeys.scoring_tasks(run_id), tid, ScoringTask(trajectory_id=tid, trajectory_key=second).model_dump_json())
    return store, tid, second


def test_the_lookup_finds_the_scored_attempt_and_its_score(recorded, redis_client, run_id):
    store, tid, second = recorded
    found = find_trajectory(store, tid, redis_client)
    assert found.key == second and found.trajectory.attempt == 2 and len(found.trajectory.turns) == 3
    assert found.scored is not None and found.scored.reward == 1.0 and found.state == "consumed"
    with pytest.raises(TrajectoryNotFound, match="no uploaded trajectory"):
        find_trajectory(store, tid.replace("_3_", "_4_"), redis_client)
    with pytest.raises(TrajectoryNotFound, match="malformed trajectory id"):
        find_trajectory(store, "not-an-id", redis_client)


def test_replay_of_a_deterministic_environment_matches_every_turn(recorded, redis_client):
    store, tid, _ = recorded
    trajectory = find_trajectory(store, tid, redis_client).trajectory
    report = asyncio.run(replay(trajectory, GuessNumberEnv()))
    assert report.matches and report.turns_replayed == 3 and report.verifier_reward == 1.0


class MovedTarget(GuessNumberEnv):
    """Changed on purpose: the number it thinks of moves after the first guess."""

    async def step(self, action: AgentAction) -> StepResult:
        if self.guesses:
            self.target = 30
        return await super().step(action)


def test_replay_reports_the_first_turn_where_a_changed_environment_answers_differently(recorded, redis_client):
    store, tid, _ = recorded
    trajectory = find_trajectory(store, tid, redis_client).trajectory
    report = asyncio.run(replay(trajectory, MovedTarget()))
    d = report.divergence
    assert (d.turn, d.what, d.recorded, d.replayed) == (2, "observation", None, "lower")  # 37 is now too high
    assert report.turns_replayed == 3


def test_agent_driven_environments_are_refused_with_the_reason(recorded, redis_client):
    store, tid, _ = recorded
    trajectory = find_trajectory(store, tid, redis_client).trajectory
    env = registry_for({}).make("agent_coding", {"agent_command": "true"})
    with pytest.raises(CannotReplay, match="agent-driven"):
        asyncio.run(replay(trajectory, env))


def test_the_cli_inspects_as_json_and_as_text_and_replays(recorded, tmp_path, redis_url, run_id):
    store, tid, second = recorded
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}, "CONVEYOR_REDIS__URL": redis_url,
           "CONVEYOR_STORAGE__BACKEND": "local", "CONVEYOR_STORAGE__LOCAL_ROOT": str(tmp_path / "objects")}

    def conveyor(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "services.cli.app", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)

    as_json = conveyor("inspect", tid, "--json")
    assert as_json.returncode == 0, as_json.stderr
    shown = json.loads(as_json.stdout)
    assert shown["key"] == second and shown["state"] == "consumed" and shown["scored"]["reward"] == 1.0
    assert [t["observation"] for t in shown["trajectory"]["turns"]] == ["lower", "higher", None]
    text = conveyor("inspect", tid)
    assert text.returncode == 0, text.stderr
    for expected in ("guess_number", "lower", "higher", "verifier 1", "policy v2", "d.jsonl:4"):
        assert expected in text.stdout, expected
    replayed = conveyor("replay", tid)
    assert replayed.returncode == 0 and "3 turns, every observation as recorded" in replayed.stdout, replayed.stderr
    missing = conveyor("replay", tid.replace("_3_", "_5_"))
    assert missing.returncode == 2 and "no uploaded trajectory" in missing.stderr
