"""The environment API (issue 11): one registry for intake and workers, fed by built-ins, the
``conveyor.environments`` entry points and settings; environments own their config and rows;
group seeding; synchronous packages off the event loop; stop reasons.

Real components: the plugin is installed with pip, textarena and skyrl-gym run from their PyPI
packages, host processes are real interpreters, the CLI runs as a subprocess. The full
pipeline (vLLM, Celery, S3) runs these environments in ``test_third_party_pipeline.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.intake.adapters import RowRejected, adapt_row
from services.intake.publisher import build_group
from services.rollout_worker.episode.loop import EpisodeLimits, _turn_budget, final_stop_reason
from services.rollout_worker.environments.hosted import POOL
from services.rollout_worker.environments.mcp_tools import McpToolEnv
from services.rollout_worker.environments.skyrl_gym_env import SkyRLGymEnv
from shared.environments import (AgentAction, EnvConfig, Environment, EnvironmentConfigError, EnvironmentRegistry,
                                 EnvironmentUnavailable, StepResult, VerifyResult, check_startup)
from shared.schemas import StopReason, TaskProfile
from shared.settings import load_settings


def text(value: str) -> AgentAction:
    return AgentAction(value, [], None)


# --- the registry ---------------------------------------------------------------------------

def test_a_plugin_installed_with_pip_registers_through_its_entry_point(plugin_on_path):
    registry = EnvironmentRegistry()
    env_type = registry.resolve("secret_game")
    assert env_type.__module__ == "conveyor_plugin_demo.env"
    assert registry.sources["secret_game"] == "entry point conveyor.environments:secret_game"
    # intake resolves the same environment, and its own Config judges env_config
    task = adapt_row({"task_data": {}, "env_config": {"isolation": "thread"}}, "secret_game", "rows.jsonl:1",
                     registry=registry)
    assert task.env_name == "secret_game" and task.env_config == {"isolation": "thread"}


def test_settings_name_a_plugin_by_module_and_class(plugin_on_path):
    registry = EnvironmentRegistry({"my_game": "conveyor_plugin_demo.env:SecretGameEnv"}, entry_points=False)
    assert registry.resolve("my_game").__name__ == "SecretGameEnv"
    assert registry.sources["my_game"] == "settings environments.my_game"
    with pytest.raises(EnvironmentUnavailable, match=r"environment 'broken' \(settings environments.broken\).*cannot be imported"):
        EnvironmentRegistry({"broken": "no_such_package_xyz.env:Game"}).resolve("broken")
    with pytest.raises(EnvironmentUnavailable, match="is not a subclass of shared.environments.Environment"):
        EnvironmentRegistry({"not_env": "shared.settings:load_settings"}).resolve("not_env")


@pytest.mark.parametrize("env_name, env_config, message", [
    ("chess", {}, "unknown environment 'chess'; registered: .*guess_number"),
    ("guess_number", {"max_turnz": 2}, r"environment 'guess_number' \(EnvConfig\): env_config.max_turnz: Extra inputs"),
    ("textarena", {}, r"environment 'textarena' \(TextArenaConfig\): env_config.env_id: Field required"),
    ("gym", {"factory": "m:f", "isolation": "fork"}, r"env_config.isolation: Input should be 'process' or 'thread'"),
])
def test_an_unknown_environment_or_bad_env_config_is_refused_before_anything_runs(env_name, env_config, message):
    registry = EnvironmentRegistry()
    with pytest.raises((EnvironmentUnavailable, EnvironmentConfigError), match=message):
        check_startup(registry, env_name, env_config)
    with pytest.raises(RowRejected, match=message):  # a row naming it is rejected with the same line
        adapt_row({"task_data": {}, "env_key": env_name, "env_config": env_config}, "qa", registry=registry)


@pytest.mark.parametrize("command", [["intake", "--dataset", "rows.jsonl"], ["worker", "rollout"]])
@pytest.mark.parametrize("variables, message", [
    ({"CONVEYOR_INTAKE__ENV_NAME": "chess"}, "error: unknown environment 'chess'; registered:"),
    ({"CONVEYOR_INTAKE__ENV_NAME": "textarena", "CONVEYOR_INTAKE__ENV_CONFIG": '{"env_id": "X", "colour": 1}'},
     "error: environment 'textarena' (TextArenaConfig): env_config.colour: Extra inputs are not permitted"),
])
def test_intake_and_the_worker_stop_at_start_with_one_line(command, variables, message, tmp_path):
    # no Redis, no model, no dataset: the environment check comes first and names the problem
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    done = subprocess.run([sys.executable, "-m", "services.cli.app", *command], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**env, **variables, "CONVEYOR_REDIS__URL": "redis://127.0.0.1:1/0"})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [message] or message in done.stderr.strip().splitlines()[-1], done.stderr


def test_rows_are_adapted_by_their_environment():
    registry = EnvironmentRegistry(entry_points=False)
    task = adapt_row({"prompt": [{"role": "user", "content": "2+2?"}], "reward_spec": {"ground_truth": "4"}},
                     "skyrl_gym", registry=registry, default_env_config={"env_class": "gsm8k"})
    assert task.task_data == {"prompt": [{"role": "user", "content": "2+2?"}], "extras": {"reward_spec": {"ground_truth": "4"}}}
    with pytest.raises(RowRejected, match="field 'prompt' must be a string or a non-empty list"):
        adapt_row({"prompt": 7}, "skyrl_gym", registry=registry, default_env_config={"env_class": "gsm8k"})
    assert SkyRLGymEnv.task_from_row({"prompt": "hi"})["prompt"] == [{"role": "user", "content": "hi"}]


# --- group seeding ----------------------------------------------------------------------------

def test_every_member_of_a_group_gets_the_group_seed_and_no_two_groups_share_one():
    settings = load_settings(run_id="seeds", rollout={"group_size": 4}, intake={"base_seed": 10})
    task = TaskProfile(task_id="t", env_name="qa", task_data={"question": "q", "answer": "a"})
    groups = [build_group(settings, group_id, task) for group_id in range(50)]
    for requests in groups:
        assert len({r.task_seed for r in requests}) == 1  # one task instance per group
        assert len({r.episode_seed for r in requests}) == 4  # the trajectories still differ
    assert len({requests[0].task_seed for requests in groups}) == 50


def _play(env_name: str, env_config: dict, seed: int, actions: list[str], registry: EnvironmentRegistry):
    async def play():
        env = registry.make(env_name, env_config)
        try:
            messages = await env.reset({}, seed)
            results = []
            for action in actions:
                results.append(await env.step(text(action)))
                if results[-1].done:
                    break
            return messages, results, await env.verify()
        finally:
            await env.close()
    return play()


def test_a_package_using_global_random_state_gives_each_group_one_game_in_concurrent_episodes(plugin_on_path):
    """8 episodes at once, 2 groups of 4: every member of a group sees the same secret, the two
    groups see different ones, and a repeat gives the same secrets (host processes)."""
    registry = EnvironmentRegistry()
    config = {"kwargs": {"step_sleep_s": 0.05}}

    async def round_of_games():
        games = [_play("secret_game", config, seed, [], registry) for seed in (101,) * 4 + (102,) * 4]
        return [messages[0]["content"] for messages, _, _ in await asyncio.gather(*games)]

    first = asyncio.run(round_of_games())
    assert len(set(first[:4])) == 1 and len(set(first[4:])) == 1 and first[0] != first[4], first
    assert asyncio.run(round_of_games()) == first


def test_textarena_game_from_its_package():
    registry = EnvironmentRegistry(entry_points=False)
    messages, results, verdict = asyncio.run(_play(
        "textarena", {"env_id": "GuessTheNumber-v0-raw"}, 5, [f"[{n}]" for n in range(1, 21)], registry))
    assert "Guess The Number" in messages[0]["content"]
    finished = [r for r in results if r.done]
    assert finished, [r.observation for r in results]
    # the game's reward arrives on the turn that ends it and is the episode's reward
    assert finished[0].reward == verdict.reward and verdict.info["finished"] is True
    again = asyncio.run(_play("textarena", {"env_id": "GuessTheNumber-v0-raw"}, 5, [f"[{n}]" for n in range(1, 21)], registry))
    assert [r.observation for r in again[1]] == [r.observation for r in results]  # same seed, same game


def test_skyrl_gym_environment_from_its_package_keeps_per_turn_rewards():
    registry = EnvironmentRegistry(entry_points=False)
    task = SkyRLGymEnv.task_from_row({"prompt": "What is 2+2?", "reward_spec": {"method": "rule", "ground_truth": "4"},
                                      "extra_info": {"max_turns": 3}})

    async def play():
        env = registry.make("skyrl_gym", {"env_class": "gsm8k_multi_turn"})
        try:
            messages = await env.reset(task, 0)
            first, second = await env.step(text("#### 5")), await env.step(text("#### 4"))
            return messages, first, second, await env.verify()
        finally:
            await env.close()

    messages, first, second, verdict = asyncio.run(play())
    assert messages == [{"role": "user", "content": "What is 2+2?"}]
    assert not first.done and 0 < first.reward < 1 and "#### ANSWER" in first.observation  # a format reward
    assert second.done and second.reward == 1.0 and verdict.reward == 1.0


class _AsyncSleeper(Environment):
    name = "async_sleeper"

    async def reset(self, task_data, seed):  # noqa: ANN001, ANN201
        await asyncio.sleep(0.2)
        return [{"role": "user", "content": "go"}]

    async def step(self, action):  # noqa: ANN001, ANN201
        await asyncio.sleep(0.2)
        return StepResult("wrong", done=False)

    async def verify(self):  # noqa: ANN201
        return VerifyResult(0.0)


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_a_blocking_step_does_not_block_other_episodes(plugin_on_path, isolation):
    """8 concurrent episodes of a game whose reset and steps block for 0.2 s take at most 1.3×
    the same episodes with awaiting steps (warm host processes, as in a running worker)."""
    registry = EnvironmentRegistry({"async_sleeper": f"{__name__}:_AsyncSleeper"})
    blocking = {"kwargs": {"step_sleep_s": 0.2}, "isolation": isolation}

    async def episodes(env_name, config):
        return await asyncio.gather(*(_play(env_name, config, seed, ["a", "b", "c"], registry) for seed in range(8)))

    asyncio.run(episodes("secret_game", blocking))  # warm-up: the pool's host processes start
    started = time.perf_counter()
    asyncio.run(episodes("async_sleeper", {}))
    awaiting_s = time.perf_counter() - started
    started = time.perf_counter()
    asyncio.run(episodes("secret_game", blocking))
    blocking_s = time.perf_counter() - started
    assert awaiting_s >= 0.8  # 4 × 0.2 s each, overlapping
    assert blocking_s <= 1.3 * awaiting_s, f"blocking {blocking_s:.2f}s vs awaiting {awaiting_s:.2f}s"


def test_a_driver_that_raises_or_a_host_that_dies_is_an_environment_error_naming_it(plugin_on_path):
    from shared.environments import EnvironmentError_

    registry = EnvironmentRegistry()
    with pytest.raises(EnvironmentError_, match="make: ImportPathError: env_config.factory 'no_such_mod_xyz:Game' cannot be imported"):
        asyncio.run(_play("gym", {"factory": "no_such_mod_xyz:Game"}, 0, [], registry))
    with pytest.raises(EnvironmentError_, match=r"step: the host process died \(exit code 3\)"):
        asyncio.run(_play("secret_game", {"kwargs": {"crash_on_step": True}}, 0, ["x"], registry))


# --- stop reasons -----------------------------------------------------------------------------

LIMITS = EpisodeLimits(max_turns=4, max_tokens_per_turn=16, max_episode_tokens=40, max_model_len=100, timeout_s=60)


def test_the_turn_budget_names_the_limit_that_set_it():
    assert _turn_budget(LIMITS, sampled_total=0, context_len=10) == (16, "turn")
    assert _turn_budget(LIMITS, sampled_total=30, context_len=10) == (10, StopReason.max_tokens)
    assert _turn_budget(LIMITS, sampled_total=0, context_len=90) == (10, StopReason.context_exhausted)
    assert _turn_budget(LIMITS, sampled_total=40, context_len=10) == (0, StopReason.max_tokens)


@pytest.mark.parametrize("stop, finish, bound, expected", [
    (StopReason.done, "stop", "turn", StopReason.done),
    (StopReason.done, "length", "turn", StopReason.truncated),  # the environment ended on a cut reply
    (StopReason.max_turns, "length", "turn", StopReason.truncated),
    (StopReason.max_turns, "length", StopReason.max_tokens, StopReason.max_tokens),  # cut by the episode budget
    (StopReason.done, "length", StopReason.context_exhausted, StopReason.context_exhausted),
    (StopReason.max_turns, "stop", "turn", StopReason.max_turns),
    (StopReason.context_exhausted, "stop", "turn", StopReason.context_exhausted),
])
def test_the_stop_reason_tells_a_truncated_reply_from_the_budgets(stop, finish, bound, expected):
    assert final_stop_reason(stop, finish, bound) == expected


def test_overlong_masking_drops_truncated_replies_only():
    from services.trainer.batching import prepare_sample
    from shared.schemas import TrainingSample

    def sample(stop):
        return TrainingSample(trajectory_id="r_0_0_0", token_ids=[1, 2, 3, 4], loss_mask=[0, 1, 1, 1],
                              inference_logprobs=[0.0, -1.0, -1.0, -1.0], advantage=1.0, stop_reason=stop,
                              oldest_policy_version=0, reward=1.0)

    assert prepare_sample(sample(StopReason.truncated), 16).overlong_masked
    for stop in (StopReason.max_tokens, StopReason.context_exhausted, StopReason.max_turns, StopReason.done):
        assert not prepare_sample(sample(stop), 16).overlong_masked, stop


def test_env_config_keys_every_environment_shares_override_the_rollout_settings():
    rollout = load_settings().rollout
    limits = EpisodeLimits.from_settings(rollout, 512, EnvConfig(max_turns=2, episode_timeout_s=5))
    assert (limits.max_turns, limits.timeout_s, limits.max_tokens_per_turn) == (2, 5.0, rollout.max_tokens_per_turn)


def teardown_module() -> None:
    POOL.shutdown()


# --- MCP tools ----------------------------------------------------------------------------------

MCP_SERVER = str(Path(__file__).parent / "mcp_shop_server.py")


def hermes(*calls: tuple[str, dict]) -> AgentAction:
    from services.rollout_worker.tool_calls import parse_tool_calls

    reply = "".join(f'<tool_call>{json.dumps({"name": n, "arguments": a})}</tool_call>' for n, a in calls)
    parsed, error = parse_tool_calls(reply)
    return AgentAction(reply, parsed, error)


def _shop(env_config: dict, task: dict, actions: list[AgentAction]):
    async def play():
        env = EnvironmentRegistry(entry_points=False).make("mcp", env_config)
        try:
            messages = await env.reset(task, 0)
            results = []
            for action in actions:
                results.append(await env.step(action))
                if results[-1].done:
                    break
            return messages, results, await env.verify()
        finally:
            await env.close()
    return asyncio.run(play())


def test_an_mcp_server_over_stdio_lists_its_tools_runs_calls_and_grades_with_its_hidden_verifier():
    config = {"command": [sys.executable, MCP_SERVER], "verifier_tool": "grade"}
    task = McpToolEnv.task_from_row({"prompt": "Buy an apple and a pear.", "verifier_args": {"expected_total": 8}})
    messages, results, verdict = _shop(config, task, [
        hermes(("price", {"item": "apple"})),
        hermes(("buy", {"item": "apple"}), ("buy", {"item": "pear"})),
        hermes(("grade", {"expected_total": 0})),  # the grader's tool is not the agent's
        hermes(("price", {"item": "kiwi"})),  # a tool error is an observation
        AgentAction("I bought them. <done>", [], None),
    ])
    system = messages[0]["content"]
    assert '"name": "price"' in system and '"name": "buy"' in system and '"grade"' not in system
    assert results[0].observation == "price returned: 3"
    assert results[1].observation == "buy returned: 3\nbuy returned: 8" and results[1].info["tool_calls"] == 2
    assert results[2].observation.startswith("Error: no tool 'grade'")
    assert results[3].observation.startswith("Error from price:") and "no such item: kiwi" in results[3].observation
    assert results[4].done and verdict.reward == 1.0 and verdict.info["tool_calls"] == 4


def test_an_mcp_server_over_streamable_http(tmp_path):
    from services.cli.local_stack import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, MCP_SERVER, str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        task = McpToolEnv.task_from_row({"prompt": "What does a fig cost?", "answer": "11"})
        _, results, verdict = _shop({"url": f"http://127.0.0.1:{port}/mcp", "tools": ["price"]}, task, [
            hermes(("buy", {"item": "fig"})),  # not in env_config.tools
            hermes(("price", {"item": "fig"})),
            AgentAction("A fig costs 11 coins.", [], None),
        ])
        assert results[0].observation.startswith("Error: no tool 'buy'") and results[1].observation == "price returned: 11"
        assert verdict.reward == 1.0
    finally:
        server.terminate()
        server.wait(10)


def test_an_unreachable_mcp_server_is_an_environment_error_and_a_bad_config_is_refused():
    from shared.environments import EnvironmentError_

    with pytest.raises(EnvironmentError_, match=r"MCP server .*no_such_server_xyz.* is unusable"):
        _shop({"command": ["no_such_server_xyz"]}, {"prompt": "p", "answer": "a"}, [])
    with pytest.raises(EnvironmentConfigError, match="give exactly one of url .* and command"):
        EnvironmentRegistry(entry_points=False).config("mcp", {"url": "http://x/mcp", "command": ["srv"]})
    with pytest.raises(RowRejected, match="nothing can score this row"):
        adapt_row({"prompt": "p"}, "mcp", default_env_config={"url": "http://x/mcp"})


def test_a_trial_counts_the_episodes_after_its_free_shots():
    from services.rollout_worker.episode.trials import Trial

    single = Trial()
    single.record(VerifyResult(0.5, {"solved": False}))
    assert single.complete and single.result() == (0.5, {"solved": False})  # one episode: unchanged
    trial = Trial(episodes=3, free_shots=1)
    trial.record(VerifyResult(1.0, {"n": 1}))
    assert not trial.complete
    assert trial.opening([{"role": "system", "content": "rules"}, {"role": "user", "content": "go"}]) == "Episode 2 of 3.\ngo"
    trial.record(VerifyResult(0.5, {"n": 2}))  # the budget ran out before the third: it counts 0
    reward, info = trial.result()
    assert reward == pytest.approx(0.25) and info["episode_rewards"] == [1.0, 0.5] and info["last_episode"] == {"n": 2}
    with pytest.raises(EnvironmentConfigError, match=r"free_shots \(2\) must be below episodes_per_trial \(2\)"):
        EnvironmentRegistry(entry_points=False).config("qa", {"episodes_per_trial": 2, "free_shots": 2})


def test_a_textarena_observation_carries_the_games_messages_not_the_agents_own_move_back():
    """TowerOfHanoi sends the agent's move back as the game (sender -1), typed PLAYER_ACTION:
    observations are chosen by type, so no turn starts with the move the agent just made."""
    registry = EnvironmentRegistry(entry_points=False)
    solution = ["[A C]", "[A B]", "[C B]", "[A C]", "[B A]", "[B C]", "[A C]"]  # the default 3 disks
    messages, results, verdict = asyncio.run(_play("textarena", {"env_id": "TowerOfHanoi-v0-raw"}, 5, solution, registry))
    assert "Tower of Hanoi" in messages[0]["content"] and "Current Board" in messages[0]["content"]
    for move, result in zip(solution, results[:-1]):
        assert not result.observation.startswith(move) and move not in result.observation, (move, result.observation)
        assert result.observation.startswith("You moved disk"), result.observation
    assert results[-1].done and verdict.reward == 1.0
