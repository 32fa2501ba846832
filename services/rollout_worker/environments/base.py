"""The one environment interface, for text environments and sandboxed ones alike.

``reset(task_data, seed)`` -> initial chat messages; ``step(action)`` -> StepResult;
``verify()`` -> VerifyResult; ``close()``. All async, so a container-backed environment can
await its sandbox without blocking the worker's event loop.

Invariants:
- An environment never raises on bad model output: a malformed or missing tool call becomes
  an error observation and the episode goes on. Raising means the environment itself broke
  (``env_error``).
- Per-environment settings (``env_config``: max turns, ...) are separate from per-task data.
"""

from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass, field
from typing import Any

from shared.schemas import ToolCall


@dataclass(frozen=True)
class AgentAction:
    text: str
    tool_calls: list[ToolCall]
    tool_call_error: str | None  # set when the text held a malformed tool call


@dataclass(frozen=True)
class StepResult:
    observation: str
    done: bool
    reward: float = 0.0  # per-step shaping reward; the verifier decides the final one
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class VerifyResult:
    reward: float
    info: dict[str, Any] = field(default_factory=dict)


class EnvironmentError_(Exception):
    """The environment itself failed (not the agent): the trajectory ends with env_error."""


class Environment(abc.ABC):
    def __init__(self, env_config: dict[str, Any] | None = None):
        self.env_config = dict(env_config or {})

    @abc.abstractmethod
    async def reset(self, task_data: dict[str, Any], seed: int) -> list[dict[str, str]]: ...

    @abc.abstractmethod
    async def step(self, action: AgentAction) -> StepResult: ...

    @abc.abstractmethod
    async def verify(self) -> VerifyResult: ...

    async def close(self) -> None:
        return None

    async def simulate_tool_latency(self) -> None:
        """``env_config["step_latency_s"]`` (default 0): each step takes that long, standing in
        for tool execution in benchmarks of orchestration overhead and async training."""
        latency = float(self.env_config.get("step_latency_s", 0.0))
        if latency > 0:
            await asyncio.sleep(latency)
