"""The episode loop: one trajectory, token-in/token-out against the inference service.

    reset -> ``take_turn`` until the ``EpisodeState`` has a stop reason -> verify -> close

``run_episode`` is that short driver; ``take_turn`` is one turn, and the only place a turn's
limits are checked.

Invariants:
- The context is a list of token ids that only grows: initial prompt ids, then per turn the
  sampled ids and the observation ids. Nothing already in it is re-tokenized.
- The loss mask is 1 exactly on sampled ids (``Trajectory.flatten``); observation ids are 0.
- Each turn's token budget is the smallest of the per-turn limit, what is left of the episode
  budget and what is left of the model's context. The stop reason says which ended the
  episode: ``max_tokens`` (the episode budget), ``context_exhausted`` (the context), or
  ``truncated`` when the episode ended on a reply cut at the per-turn limit (the only case
  overlong masking drops); ``max_turns`` and ``done`` otherwise.
- The environment's per-turn reward and info are kept on each ``Turn``.
- With ``episodes_per_trial`` above 1, an episode the environment ends is verified, and the
  next one of the trial starts in the same context (``trials``); the trajectory ends when the
  trial does. Its reward is the trial's.
- Bad model output never raises here (the environment answers it); an environment that raises
  ends the episode with ``env_error``, and a Trajectory comes back with the turns done so far.
  Infra errors are raised, not recorded: inference failing a request or unreachable past
  ``outage.limit_s`` (``inference_client``), the sandbox daemon failing (``SandboxInfraError``);
  the runner classifies them. The environment is closed either way.
- Time spent waiting out an inference outage does not count against ``episode_timeout_s``.
- The sampling seed of a turn is a hash of (trajectory id, turn), so a turn can be replayed
  exactly, and no two trajectories share one. The environment's ``reset`` gets the group's
  task seed (``RolloutRequest.task_seed``): every member of a GRPO group plays the same task
  instance, and no two groups of a run share a seed. (The episode seed,
  ``base_seed + group_id + index``, repeats across groups: group g, episode i+1 has the seed of
  group g+1, episode i. It only names the trajectory.)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, cast

from services.rollout_worker.chat_tokens import ChatTokens
from shared.environments import AgentAction, EnvConfig, Environment
from services.rollout_worker.inference_client import InferenceClient
from services.rollout_worker.served_version import read_fresh
from services.rollout_worker.sandbox.errors import SandboxInfraError
from services.rollout_worker.tool_calls import parse_tool_calls
from services.rollout_worker.episode.trials import Trial
from shared.schemas import EpisodeTimings, RolloutRequest, StopReason, Trajectory, Turn, TurnTimings
from shared.settings import RolloutSettings


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    max_tokens_per_turn: int
    max_episode_tokens: int
    max_model_len: int
    timeout_s: float
    temperature: float = 1.0
    top_p: float = 1.0

    @classmethod
    def from_settings(cls, rollout: RolloutSettings, max_model_len: int, config: EnvConfig) -> "EpisodeLimits":
        """The environment's validated ``env_config`` overrides the rollout settings key by key."""
        def pick(value, default):
            return default if value is None else value

        return cls(
            max_turns=pick(config.max_turns, rollout.max_turns),
            max_tokens_per_turn=pick(config.max_tokens_per_turn, rollout.max_tokens_per_turn),
            max_episode_tokens=pick(config.max_episode_tokens, rollout.max_episode_tokens),
            max_model_len=max_model_len,
            timeout_s=float(pick(config.episode_timeout_s, rollout.episode_timeout_s)),
            temperature=rollout.sampling.temperature,
            top_p=rollout.sampling.top_p,
        )


def turn_seed(trajectory_id: str, turn_index: int) -> int:
    digest = hashlib.sha256(f"{trajectory_id}:{turn_index}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


@dataclass
class EpisodeState:
    """One episode so far; ``take_turn`` moves it on by one turn, and sets ``stop`` when it ends.

    ``next_ids``: the ids the next turn's prompt adds to the context (the initial prompt, then
    each observation's); ``last_bound``: which limit set the last turn's token budget."""

    request: RolloutRequest
    trial: Trial
    role: str
    started: float = field(default_factory=time.time)
    next_ids: list[int] = field(default_factory=list)
    context: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    sampled_total: int = 0
    last_bound: StopReason | str = "turn"
    outage_s: float = 0.0  # waited out for inference: not the episode's time
    stop: StopReason | None = None  # None while the episode goes on


async def take_turn(state: EpisodeState, env: Environment, client: InferenceClient, chat: ChatTokens,
                    limits: EpisodeLimits, policy_version: Callable[[], int]) -> EpisodeState:
    """One turn: sample a reply within the turn's budget, step the environment with it, keep the
    turn. Ends the episode (``state.stop``) when a limit leaves no turn to take, or when the
    environment (the trial's last episode) is done; ``EnvironmentFailure`` when it raises."""
    index = len(state.turns)
    if index >= limits.max_turns:
        state.stop = StopReason.max_turns
        return state
    budget, bound = _turn_budget(limits, state.sampled_total, len(state.context) + len(state.next_ids))
    if budget <= 0:  # the per-turn limit is positive (settings): an episode-wide limit, a StopReason
        state.stop = cast(StopReason, bound)
        return state
    state.last_bound = bound
    remaining_s = limits.timeout_s - (time.time() - state.started - state.outage_s)
    if remaining_s <= 0:
        state.stop = StopReason.timeout
        return state
    state.context += state.next_ids
    request, trial = state.request, state.trial
    version = await read_fresh(policy_version)  # a Redis read, shared by concurrent turns (served_version)
    t0 = time.perf_counter()
    completion = await client.complete(
        state.context, budget, turn_seed(request.trajectory_id, index), limits.temperature, limits.top_p,
        budget_s=remaining_s, policy_version=version,
    )
    state.outage_s += completion.outage_wait_s
    inference_s = time.perf_counter() - t0 - completion.outage_wait_s
    state.context += completion.token_ids
    state.sampled_total += len(completion.token_ids)
    text = chat.decode(completion.token_ids)
    calls, call_error = parse_tool_calls(text)
    t1 = time.perf_counter()
    with environment_call(f"step {index}"):
        result = await env.step(AgentAction(text, calls, call_error))
    observation = None if result.done else result.observation
    if result.done and trial.episodes > 1:
        with environment_call(f"verify episode {len(trial.verdicts) + 1}"):
            trial.record(await env.verify())
        if not trial.complete:  # the next episode of the trial: same task, fresh environment
            with environment_call(f"reset episode {len(trial.verdicts) + 1}"):
                await env.close()
                observation = trial.opening(await env.reset(request.task.task_data, request.task_seed))
    env_step_s = time.perf_counter() - t1
    state.turns.append(Turn(
        index=index, prompt_token_ids=state.next_ids, sampled_token_ids=completion.token_ids,
        logprobs=completion.logprobs, policy_version=version, finish_reason=completion.finish_reason,
        completion_text=text, tool_calls=calls, tool_call_error=call_error, observation=observation,
        reward=_finite(result.reward, index), info=_json_values(result.info),
        timings=TurnTimings(inference_s=inference_s, env_step_s=env_step_s),
    ))
    if observation is None:
        state.stop = StopReason.done
        return state
    ended_with_eos = bool(completion.token_ids) and completion.token_ids[-1] == chat.eos_token_id
    state.next_ids = chat.observation_ids(observation, ended_with_eos, state.role)
    return state


async def run_episode(
    request: RolloutRequest,
    env: Environment,
    client: InferenceClient,
    chat: ChatTokens,
    limits: EpisodeLimits,
    policy_version: Callable[[], int],
    attempt: int = 1,
    worker: str = "",
) -> Trajectory:
    state = EpisodeState(request, Trial(env.config.episodes_per_trial, env.config.free_shots), env.role_of_observations())
    stop, error, env_reward = StopReason.max_turns, None, None
    env_info: dict[str, Any] = {}
    prompt_messages: list[dict[str, str]] = []
    env.seed_tool_latency(request.trajectory_id)
    try:
        with environment_call("reset"):
            messages = await env.reset(request.task.task_data, request.task_seed)
        state.next_ids = chat.initial_prompt(messages)
        prompt_messages = [{"role": str(m.get("role", "")), "content": str(m.get("content", ""))} for m in messages]
        while state.stop is None:
            await take_turn(state, env, client, chat, limits, policy_version)
        stop = state.stop
        if state.turns:
            stop = final_stop_reason(stop, state.turns[-1].finish_reason, state.last_bound)
        if not state.trial.complete:
            with environment_call("verify"):
                state.trial.record(await env.verify())
        env_reward, env_info = state.trial.result()
    except EnvironmentFailure as exc:
        stop, error = StopReason.env_error, str(exc)
    except asyncio.TimeoutError:
        stop, error = StopReason.timeout, f"episode exceeded {limits.timeout_s}s"
    finally:
        try:
            await env.close()
        except Exception as exc:  # a failed close must not hide the episode's outcome
            error = error or f"close: {type(exc).__name__}: {exc}"
    turns = state.turns
    timings = EpisodeTimings(
        queue_wait_s=max(0.0, state.started - request.dispatched_at),
        episode_s=time.time() - state.started,
        inference_s=sum(t.timings.inference_s for t in turns),
        env_s=sum(t.timings.env_step_s for t in turns),
    )
    return Trajectory(
        request=request, turns=turns, stop_reason=stop, error=error, env_reward=env_reward,
        env_info=env_info, attempt=attempt, worker=worker, timings=timings,
        prompt_messages=prompt_messages, observation_role=state.role,
    )


def _turn_budget(limits: EpisodeLimits, sampled_total: int, context_len: int) -> tuple[int, StopReason | str]:
    """(tokens the next reply may have, which limit set it: ``"turn"``, ``max_tokens`` or
    ``context_exhausted``). Ties go to the per-turn limit, then the episode budget."""
    options = [
        (limits.max_tokens_per_turn, "turn"),
        (limits.max_episode_tokens - sampled_total, StopReason.max_tokens),
        (limits.max_model_len - context_len, StopReason.context_exhausted),
    ]
    return min(options, key=lambda option: option[0])


def final_stop_reason(stop: StopReason, last_finish_reason: str, last_bound: StopReason | str) -> StopReason:
    """An episode that ended (done, or out of turns) on a reply cut at its token limit: cut by
    the per-turn limit is ``truncated``; cut by what was left of the episode budget or the
    context is that budget's reason. Any other ending keeps its reason."""
    if stop not in (StopReason.done, StopReason.max_turns) or last_finish_reason != "length":
        return stop
    return StopReason.truncated if last_bound == "turn" else StopReason(last_bound)


def _finite(reward: float, index: int) -> float:
    value = float(reward)
    if not math.isfinite(value):
        raise EnvironmentFailure(f"step {index}: the environment returned a non-finite reward {value}")
    return value


def _json_values(info: dict) -> dict:
    """The step's info as JSON values (what a trajectory object holds); other values become strings."""
    return json.loads(json.dumps(dict(info or {}), default=str)) if info else {}


class EnvironmentFailure(Exception):
    pass


@contextmanager
def environment_call(what: str) -> Iterator[None]:
    """An exception of the environment ends the episode with env_error, except the sandbox
    daemon failing: an infra error, raised for the runner to retry in a fresh sandbox."""
    try:
        yield
    except SandboxInfraError:
        raise
    except Exception as exc:  # the environment broke, not the agent
        raise EnvironmentFailure(f"{what}: {type(exc).__name__}: {exc}") from exc
