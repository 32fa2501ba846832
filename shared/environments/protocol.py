"""The one environment API, for text environments, sandboxed ones and third-party adapters.

An environment is a class with:
- ``name``: the name rows and settings use (``env_key``/``env_name``, ``intake.env_name``);
- ``Config``: its settings model, a subclass of ``EnvConfig`` (``extra="forbid"``), validated
  from ``env_config`` at intake and again on the worker;
- ``task_from_row(data)``: a dataset row's fields -> ``task_data``, or ``RowRejected`` naming
  the bad field; ``check_task(task_data, config)``: intake-time checks that need the
  environment's settings (a repository fetch, an import), ``RowRejected`` too;
- ``reset(task_data, seed)`` -> the initial chat messages; ``step(action)`` -> ``StepResult``;
  ``verify()`` -> ``VerifyResult``; ``close()``. All async, so a container-backed environment
  awaits its sandbox without blocking the worker's event loop.

Capabilities beyond that are declared, never probed with ``getattr``: the episode path checks
``isinstance`` against these protocols (``runtime_checkable``, so the check is structural):
- ``SandboxedEnvironment``: ``bind_trajectory(run_id=, group_id=, trajectory_id=)`` labels the
  environment's containers with the trajectory (for the janitor), before ``reset``;
- ``AgentDrivenEnvironment``: a sandboxed environment whose own agent makes the model calls
  (``attach_agent(endpoint)``, ``run_agent()``); the agent driver runs it, not the token loop;
- ``ArtifactWriter``: ``write_artifacts(store, run_id, trajectory_id, info)`` writes the
  trajectory's artifacts (a coding environment's diff, test output, command log) from its
  ``env_info``; the episode driver calls it once the episode ended without ``env_error``.
The rule: an environment has a capability when it defines the protocol's methods. Built-in
environments also subclass the protocol, so mypy checks their signatures; a third-party plugin
that merely defines the methods keeps working, since the ``isinstance`` check is structural.

Invariants:
- ``reset``'s seed is the group's task seed: every member of a GRPO group gets the same task
  instance, and no two groups of a run share it (``shared.schemas.RolloutRequest.task_seed``). Sampling seeds are
  per trajectory and turn, elsewhere.
- An environment never raises on bad model output: a malformed or missing tool call becomes an
  error observation and the episode goes on. Raising means the environment itself broke
  (``env_error``). ``EnvironmentUnavailable`` and ``EnvironmentConfigError`` mean the task can
  never run on this deployment: failed at once, never retried as an infra error.
- Per-environment settings (``env_config``) are separate from per-task data (``task_data``).
  The keys every environment shares (turn and token budgets, the episode timeout, the
  observation role) are ``EnvConfig``'s; the episode runner reads them from the validated model.
"""

from __future__ import annotations

import abc
import asyncio
import math
import random
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.schemas import ToolCall


class RowRejected(ValueError):
    """A dataset row that cannot become a task; the message names the bad field."""


class EnvironmentUnavailable(LookupError):
    """No environment of that name is registered here (built-in, entry point or settings)."""


class EnvironmentConfigError(ValueError):
    """``env_config`` does not fit the environment's ``Config``; the message names the field."""


class EnvironmentError_(Exception):
    """The environment itself failed (not the agent): the trajectory ends with env_error."""


class EnvConfig(BaseModel):
    """Keys every environment accepts in ``env_config``. ``None`` means the rollout settings' value.

    Subclasses add their own fields and keep ``extra="forbid"``: a misspelt key is an error at
    intake, not a silently ignored setting."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_turns: int | None = Field(None, gt=0)
    max_tokens_per_turn: int | None = Field(None, gt=0)
    max_episode_tokens: int | None = Field(None, gt=0)  # sampled tokens across all turns
    episode_timeout_s: float | None = Field(None, gt=0)
    # each step takes this long, standing in for tool execution in benchmarks; with
    # step_latency_p99_s, step_latency_s is the median of a lognormal draw per step instead
    # (seeded per trajectory: ``seed_tool_latency``), a long-tailed tool time as on agentic tasks
    step_latency_s: float = Field(0.0, ge=0)
    step_latency_p99_s: float | None = Field(None, gt=0)
    # the chat role observations are rendered with; None: the environment's own default
    observation_role: Literal["user", "tool"] | None = None
    # several episodes of the task in one trajectory; the first free_shots do not count
    # (services/rollout_worker/episode/trials.py)
    episodes_per_trial: int = Field(1, ge=1)
    free_shots: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _counted_episodes(self) -> "EnvConfig":
        if self.free_shots >= self.episodes_per_trial:
            raise ValueError(f"free_shots ({self.free_shots}) must be below episodes_per_trial "
                             f"({self.episodes_per_trial}): some episode must count")
        p99 = self.step_latency_p99_s
        if p99 is not None and not 0 < self.step_latency_s <= p99:
            raise ValueError(f"step_latency_p99_s ({p99}) needs a median step_latency_s above 0 and "
                             f"at most it (got {self.step_latency_s})")
        return self


@dataclass(frozen=True)
class AgentAction:
    text: str
    tool_calls: list[ToolCall]
    tool_call_error: str | None  # set when the text held a malformed tool call


@dataclass(frozen=True)
class StepResult:
    observation: str
    done: bool
    reward: float = 0.0  # this turn's reward; kept on the turn (the verifier decides the final one)
    info: dict[str, Any] = field(default_factory=dict)  # kept on the turn; must be JSON-serialisable


@dataclass(frozen=True)
class VerifyResult:
    reward: float
    info: dict[str, Any] = field(default_factory=dict)


class Environment(abc.ABC):
    name: str  # each class sets it; MainThreadFallback takes the one of the environment it wraps
    Config: ClassVar[type[EnvConfig]] = EnvConfig
    observation_role: ClassVar[str] = "user"  # default for ``EnvConfig.observation_role``
    _tool_latency_rng: random.Random | None = None  # ``seed_tool_latency``

    def __init__(self, env_config: dict[str, Any] | EnvConfig | None = None):
        if isinstance(env_config, EnvConfig):
            self.config = env_config
        else:
            self.config = validate_config(type(self), env_config or {})
        self.env_config = self.config.model_dump(exclude_unset=True)

    # --- intake side: rows -> task data -----------------------------------------------------
    @classmethod
    def task_from_row(cls, data: dict[str, Any]) -> dict[str, Any]:
        """The row's fields (``task_data``, or the row itself) -> task data; ``RowRejected``."""
        return dict(data)

    @classmethod
    def prompt_text(cls, task_data: dict[str, Any]) -> str | None:
        """The task's prompt as text, for intake's context-length check (None: not known)."""
        for key in ("prompt", "question", "problem_statement"):
            value = task_data.get(key)
            if isinstance(value, str):
                return value
            if isinstance(value, list):  # chat messages
                return "\n".join(str(m.get("content", "")) for m in value if isinstance(m, dict))
        return None

    @classmethod
    def check_task(cls, task_data: dict[str, Any], config: Any) -> dict[str, Any]:
        """Checks that need the environment's settings; ``RowRejected``. Runs at intake only.
        ``config``: this class's own ``Config`` (what ``validate_config`` returns for it)."""
        return task_data

    # --- worker side: one episode -----------------------------------------------------------
    @abc.abstractmethod
    async def reset(self, task_data: dict[str, Any], seed: int) -> list[dict[str, str]]: ...

    @abc.abstractmethod
    async def step(self, action: AgentAction) -> StepResult: ...

    @abc.abstractmethod
    async def verify(self) -> VerifyResult: ...

    async def close(self) -> None:
        return None

    def role_of_observations(self) -> str:
        return self.config.observation_role or self.observation_role

    def seed_tool_latency(self, seed: int | str) -> None:
        """Seeds the draws of ``tool_latency_s``. The episode runner passes the trajectory id: the
        members of a group draw apart, no two trajectories share draws (episode seeds do: member i
        of group g and member i - 1 of group g + 1), and a rerun draws the same."""
        self._tool_latency_rng = random.Random(seed)

    def tool_latency_s(self) -> float:
        """This step's simulated tool time: ``step_latency_s``, or with ``step_latency_p99_s`` a
        lognormal draw with that median and 99th percentile (unseeded: seed 0)."""
        median, p99 = self.config.step_latency_s, self.config.step_latency_p99_s
        if p99 is None:
            return median
        if self._tool_latency_rng is None:
            self._tool_latency_rng = random.Random(0)
        return self._tool_latency_rng.lognormvariate(math.log(median), math.log(p99 / median) / NormalDist().inv_cdf(0.99))

    async def simulate_tool_latency(self) -> None:
        """``env_config.step_latency_s`` (default 0): each step takes that long
        (``tool_latency_s``)."""
        latency = self.tool_latency_s()
        if latency > 0:
            await asyncio.sleep(latency)


def validate_config(env_type: type[Environment], env_config: dict[str, Any]) -> EnvConfig:
    """``env_config`` -> the environment's ``Config``, or ``EnvironmentConfigError`` naming the
    environment and every bad field (at most three)."""
    from pydantic import ValidationError

    if not isinstance(env_config, dict):
        raise EnvironmentConfigError(f"env_config of environment {env_type.name!r} must be an object, "
                                     f"got {type(env_config).__name__}")
    try:
        return env_type.Config.model_validate(env_config)
    except ValidationError as exc:
        problems = "; ".join(f"env_config.{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}"
                             for e in exc.errors()[:3])
        raise EnvironmentConfigError(f"environment {env_type.name!r} ({env_type.Config.__name__}): {problems}") from None


@runtime_checkable
class SandboxedEnvironment(Protocol):
    """An environment whose containers carry the trajectory's labels (the module docstring)."""

    def bind_trajectory(self, *, run_id: str, group_id: str | int, trajectory_id: str) -> None: ...


@runtime_checkable
class AgentDrivenEnvironment(SandboxedEnvironment, Protocol):
    """A sandboxed environment driven by an agent of its own: ``attach_agent`` takes the proxy
    session's endpoint before ``reset``; ``run_agent`` returns when the agent exits or is stopped
    (``services.rollout_worker.environments.agent_coding``: ``AgentEndpoint``, ``AgentRun``)."""

    def attach_agent(self, endpoint: Any) -> None: ...
    async def reset(self, task_data: dict[str, Any], seed: int) -> list[dict[str, str]]: ...
    async def run_agent(self) -> Any: ...
    async def verify(self) -> VerifyResult: ...
    async def close(self) -> None: ...


@runtime_checkable
class ArtifactWriter(Protocol):
    """An environment that writes a finished trajectory's artifacts to the object store from its
    ``env_info``; returns the keys written, by artifact name."""

    def write_artifacts(self, store: Any, run_id: str, trajectory_id: str, info: dict[str, Any]) -> dict[str, str]: ...
