"""Replay of a sandboxed environment (issue 14, item 3): a coding episode recorded with a
scripted agent is replayed in a fresh sandbox on the real Docker daemon and matches turn by
turn (the verifier gives 1.0 again); a recording whose observation differs is reported at that
turn, the way a flaky environment shows up."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.rollout_worker.replay import replay
from shared.schemas import RolloutRequest, StopReason, TaskProfile, Trajectory, Turn

from coding_helpers import call, run_scripted

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]

SCRIPT = [
    call("bash", command="python3 -c 'import calc; print(calc.add(2, 3))'"),
    call("str_replace", path="calc/__init__.py", old="def add(a, b):\n    return a - b", new="def add(a, b):\n    return a + b"),
    call("str_replace", path="calc/__init__.py", old="def mul(a, b):\n    return a + b", new="def mul(a, b):\n    return a * b"),
    call("submit"),
]


def recorded(swe_task: dict, messages: list, observations: list[str], reward: float) -> Trajectory:
    task = TaskProfile(task_id="calc", env_name="coding", task_data=swe_task)
    request = RolloutRequest(run_id="replay", group_id=0, episode_index=0, episode_seed=0, trajectory_id="replay_0_0_0",
                             group_size=1, task=task, dispatched_at=time.time())
    turns = [Turn(index=i, prompt_token_ids=[1], sampled_token_ids=[2], logprobs=[-0.1], policy_version=0,
                  finish_reason="stop", completion_text=text, observation=None if i == len(SCRIPT) - 1 else obs)
             for i, (text, obs) in enumerate(zip(SCRIPT, observations))]
    return Trajectory(request=request, turns=turns, stop_reason=StopReason.done, prompt_messages=messages, env_reward=reward)


def test_a_coding_episode_replays_in_a_fresh_sandbox_and_a_changed_observation_is_found(make_env, swe_task):
    messages, observations, verdict = asyncio.run(run_scripted(make_env(), swe_task, SCRIPT))
    assert verdict.reward == 1.0, verdict.info
    trajectory = recorded(swe_task, messages, observations, verdict.reward)

    report = asyncio.run(replay(trajectory, make_env()))
    assert report.matches and report.turns_replayed == 4 and report.verifier_reward == 1.0

    flaky = trajectory.model_copy(update={"turns": [trajectory.turns[0].model_copy(update={"observation": "5\n[exit code 0]"}),
                                                    *trajectory.turns[1:]]})
    report = asyncio.run(replay(flaky, make_env()))
    d = report.divergence
    assert (d.turn, d.what, d.recorded, d.replayed) == (0, "observation", "5\n[exit code 0]", "-1\n[exit code 0]")
