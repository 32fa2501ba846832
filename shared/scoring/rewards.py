"""Reward functions and their weighted combination.

A reward function takes a Trajectory and returns a float. Built-ins:
- ``verifier``: the environment's own verdict (``Trajectory.env_reward``; 0 when it has none),
- ``format``: the share of turns whose output held at least one well-formed tool call,
- ``brevity``: 1 - sampled tokens / the episode token budget, a length-shaping term.
Any other name is an import path ``module:function``.

Invariant: the combined reward is ``sum(weight * fn(trajectory))`` over the configured
functions, and each component is kept beside it for inspection. A function that raises or
returns a non-finite number is an error naming the function, never a silent 0.

Where a reward is computed: on the scorer service, unless every configured function is
declared cheap (``in_worker``) and ``rewards.in_worker`` is ``auto``; then the rollout worker
that uploaded the trajectory scores it with no scoring hop (``services.rollout_worker.
worker_scoring``). A function qualifies when it is a pure function of the ``Trajectory`` it is
given: it needs no sandbox, network, judge model, GPU or torch (the worker has none), touches
no state outside the trajectory, and returns within milliseconds, so scoring in the worker
neither slows its episodes nor gives another value than the scorer would. The built-ins
qualify; a function named by import path runs in the worker only if it declares so
(``@in_worker``): undeclared, it is presumed expensive, and it stays on the scorer.
"""

from __future__ import annotations

from functools import partial
import math
from typing import Callable, TypeVar

from shared.import_path import ImportPathError, import_callable
from shared.schemas import RewardBreakdown, Trajectory

RewardFn = Callable[[Trajectory], float]
DeclaredFn = TypeVar("DeclaredFn", bound=Callable[..., float])
IN_WORKER_MARK = "conveyor_in_worker"  # the attribute ``in_worker`` sets on a function


def in_worker(fn: DeclaredFn) -> DeclaredFn:
    """Declare a reward function cheap enough to run in the rollout worker (this module's
    docstring says what qualifies); returns it unchanged but for the mark."""
    setattr(fn, IN_WORKER_MARK, True)
    return fn


def declared_in_worker(fn: RewardFn) -> bool:
    return getattr(fn, IN_WORKER_MARK, False) is True


@in_worker
def verifier_reward(trajectory: Trajectory) -> float:
    return float(trajectory.env_reward or 0.0)


@in_worker
def format_reward(trajectory: Trajectory) -> float:
    if not trajectory.turns:
        return 0.0
    good = sum(1 for t in trajectory.turns if t.tool_calls and not t.tool_call_error)
    return good / len(trajectory.turns)


@in_worker
def brevity_reward(trajectory: Trajectory, default_budget: int = 256) -> float:
    sampled = sum(len(t.sampled_token_ids) for t in trajectory.turns)
    budget = int(trajectory.request.task.env_config.get("max_episode_tokens", default_budget))
    return max(0.0, 1.0 - sampled / max(budget, 1))


BUILTIN: dict[str, RewardFn] = {"verifier": verifier_reward, "format": format_reward, "brevity": brevity_reward}


class RewardError(ValueError):
    pass


def resolve(name: str) -> RewardFn:
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        raise RewardError(f"reward function {name!r}: not a built-in ({sorted(BUILTIN)}) nor 'module:function'")
    try:
        return import_callable(name, "reward function")
    except ImportPathError as exc:
        raise RewardError(str(exc)) from exc


class RewardCombiner:
    def __init__(self, weights: dict[str, float], episode_token_budget: int = 256):
        if not weights:
            raise RewardError("no reward functions configured")
        self.functions = {name: (resolve(name), weight) for name, weight in weights.items()}
        # the functions not declared cheap (read before any is wrapped): none, and the rollout worker may score
        self.not_in_worker = sorted(name for name, (fn, _) in self.functions.items() if not declared_in_worker(fn))
        if "brevity" in self.functions:
            self.functions["brevity"] = (partial(brevity_reward, default_budget=episode_token_budget), weights["brevity"])

    def score(self, trajectory: Trajectory) -> tuple[float, list[RewardBreakdown]]:
        parts = []
        for name, (fn, weight) in self.functions.items():
            try:
                value = float(fn(trajectory))
            except Exception as exc:
                raise RewardError(f"reward function {name!r} raised {type(exc).__name__}: {exc}") from exc
            if not math.isfinite(value):
                raise RewardError(f"reward function {name!r} returned {value}")
            parts.append(RewardBreakdown(name=name, value=value, weight=weight))
        return sum(p.value * p.weight for p in parts), parts
