"""The episode driver's state transitions (``services.rollout_worker.episode.loop``): what one
``take_turn`` does to an ``EpisodeState``, and which stop reason ends the episode.

The policy is ``scripted_completions`` (vLLM's token API answering with known replies, no
model run) behind the real ``InferenceClient``; the tokenizer is the tiny model's. The
environment is a test double that ends when the reply says ``bye``.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from scripted_completions import scripted_completions

from services.inference.tiny_model import generate_tiny_model
from services.rollout_worker.chat_tokens import load_chat_tokens
from services.rollout_worker.episode.loop import EpisodeLimits, EpisodeState, run_episode, take_turn
from services.rollout_worker.inference_client import InferenceClient
from services.rollout_worker.episode.trials import Trial
from shared import ids
from shared.environments import AgentAction, Environment, StepResult, VerifyResult
from shared.schemas import RolloutRequest, StopReason, TaskProfile

REPLIES = ["hello there", "<tool_call>{not json</tool_call>", "bye now"]


class EndsOnBye(Environment):
    name = "test_ends_on_bye"

    def __init__(self) -> None:
        super().__init__()
        self.actions: list[AgentAction] = []

    async def reset(self, task_data, seed):  # noqa: ANN001, ANN201
        return [{"role": "user", "content": "talk to me"}]

    async def step(self, action: AgentAction) -> StepResult:
        self.actions.append(action)
        if action.tool_call_error:
            return StepResult(f"error: {action.tool_call_error}", done=False)
        return StepResult("go on", done="bye" in action.text, reward=0.5)

    async def verify(self) -> VerifyResult:
        return VerifyResult(1.0, {"turns": len(self.actions)})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return generate_tiny_model(tmp_path_factory.mktemp("episode_state") / "tiny")


@pytest.fixture(scope="module")
def chat(model_dir):
    return load_chat_tokens(model_dir)


@pytest.fixture
def policy(model_dir):
    with scripted_completions(model_dir, "tiny", REPLIES) as scripted:
        yield scripted


def _request() -> RolloutRequest:
    seed = ids.episode_seed(0, 0, 0)
    return RolloutRequest(run_id="episodestate", group_id=0, episode_index=0, episode_seed=seed,
                          trajectory_id=ids.trajectory_id("episodestate", 0, 0, seed), group_size=1,
                          task=TaskProfile(task_id="t0", env_name=EndsOnBye.name, task_data={}), dispatched_at=time.time())


def _limits(**overrides) -> EpisodeLimits:
    return EpisodeLimits(**{"max_turns": 5, "max_tokens_per_turn": 64, "max_episode_tokens": 512,
                            "max_model_len": 2048, "timeout_s": 60.0, **overrides})


def _turns(policy, chat, limits: EpisodeLimits, count: int) -> tuple[EpisodeState, EndsOnBye]:
    """A fresh episode after ``reset``, moved on by ``count`` calls of ``take_turn``."""
    async def go():
        env, client = EndsOnBye(), InferenceClient(policy.base_url, "tiny", timeout_s=10)
        state = EpisodeState(_request(), Trial(), env.role_of_observations())
        try:
            state.next_ids = chat.initial_prompt(await env.reset({}, 0))
            for _ in range(count):
                await take_turn(state, env, client, chat, limits, lambda: 7)
        finally:
            await client.aclose()
        return state, env
    return asyncio.run(go())


def test_a_turn_taken_keeps_the_turn_and_the_observation_is_the_next_prompt(policy, chat):
    state, env = _turns(policy, chat, _limits(), 1)
    assert state.stop is None
    [turn] = state.turns
    assert (turn.index, turn.completion_text.startswith("hello there"), turn.observation, turn.reward) == (0, True, "go on", 0.5)
    assert turn.policy_version == 7 and turn.finish_reason == "stop"
    assert state.sampled_total == len(turn.sampled_token_ids) > 0
    assert state.context == turn.prompt_token_ids + turn.sampled_token_ids  # the observation is not in it yet
    assert state.next_ids and chat.decode(state.next_ids).count("go on") == 1
    assert [a.text for a in env.actions] == [turn.completion_text]


def test_model_output_that_fails_to_parse_is_answered_and_the_episode_goes_on(policy, chat):
    state, env = _turns(policy, chat, _limits(), 2)
    assert state.stop is None
    bad = state.turns[1]
    assert bad.tool_calls == [] and "not valid JSON" in (bad.tool_call_error or "")
    assert bad.observation == f"error: {bad.tool_call_error}"
    assert env.actions[1].tool_call_error == bad.tool_call_error


def test_the_environment_being_done_ends_the_episode_with_no_observation(policy, chat):
    state, _ = _turns(policy, chat, _limits(), 3)
    assert state.stop is StopReason.done
    assert len(state.turns) == 3 and state.turns[-1].observation is None
    assert state.context[-len(state.turns[-1].sampled_token_ids):] == state.turns[-1].sampled_token_ids


def test_max_turns_cuts_the_episode_without_sampling_again(policy, chat):
    state, _ = _turns(policy, chat, _limits(max_turns=1), 2)
    assert state.stop is StopReason.max_turns
    assert len(state.turns) == 1 and len(policy.requests) == 1


def test_a_reply_cut_at_the_per_turn_limit_ends_the_episode_truncated(policy, chat):
    limits = _limits(max_turns=1, max_tokens_per_turn=2)
    state, _ = _turns(policy, chat, limits, 2)
    assert state.stop is StopReason.max_turns and state.last_bound == "turn"
    assert state.turns[0].finish_reason == "length" and len(state.turns[0].sampled_token_ids) == 2

    async def whole_episode():
        client = InferenceClient(policy.base_url, "tiny", timeout_s=10)
        try:
            return await run_episode(_request(), EndsOnBye(), client, chat, limits, lambda: 7)
        finally:
            await client.aclose()
    trajectory = asyncio.run(whole_episode())
    assert trajectory.stop_reason is StopReason.truncated
    assert (trajectory.env_reward, trajectory.env_info) == (1.0, {"turns": 1})


def test_the_episode_token_budget_spent_ends_it_with_max_tokens(policy, chat):
    state, _ = _turns(policy, chat, _limits(max_tokens_per_turn=3, max_episode_tokens=3), 2)
    assert state.stop is StopReason.max_tokens
    assert len(state.turns) == 1 and state.sampled_total == 3 and len(policy.requests) == 1


def test_a_context_too_full_for_another_reply_ends_it_with_context_exhausted(policy, chat):
    prompt_len = len(chat.initial_prompt([{"role": "user", "content": "talk to me"}]))
    state, _ = _turns(policy, chat, _limits(max_model_len=prompt_len), 1)
    assert state.stop is StopReason.context_exhausted
    assert state.turns == [] and policy.requests == []


def test_an_episode_out_of_time_ends_with_timeout_before_sampling(policy, chat):
    state, _ = _turns(policy, chat, _limits(timeout_s=1e-9), 1)
    assert state.stop is StopReason.timeout
    assert state.turns == [] and policy.requests == []
