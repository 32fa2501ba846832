"""Single-turn tasks defined by data plus a reward function: how users bring their own
verifiable tasks with no code change in Conveyor.

Task data: ``{"prompt": str, "row": {...the dataset row...}}``. Environment config:
``reward_fn`` is an import path ``module:function``; the function takes the completion text
and the row and returns a number. The verifier's reward is that number.

Invariant: a reward function that cannot be imported, raises, or returns a non-number is an
environment error naming the function (the trajectory fails with the reason), never a
silent reward of 0.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Callable

from services.rollout_worker.environments.base import AgentAction, Environment, StepResult, VerifyResult
from shared.import_path import import_callable


@lru_cache(maxsize=32)
def import_reward_fn(path: str) -> Callable[[str, dict[str, Any]], float]:
    return import_callable(path, "reward_fn")


class SingleTurnEnv(Environment):
    name = "single_turn"

    async def reset(self, task_data: dict[str, Any], seed: int) -> list[dict[str, str]]:
        self.row = dict(task_data.get("row") or {})
        self.reply = ""
        self.reward_fn = import_reward_fn(str(self.env_config.get("reward_fn", "")))
        messages = [{"role": "user", "content": str(task_data["prompt"])}]
        if self.env_config.get("system_prompt"):
            messages.insert(0, {"role": "system", "content": str(self.env_config["system_prompt"])})
        return messages

    async def step(self, action: AgentAction) -> StepResult:
        await self.simulate_tool_latency()
        self.reply = action.text
        return StepResult("", done=True)

    async def verify(self) -> VerifyResult:
        value = float(self.reward_fn(self.reply, self.row))
        if not math.isfinite(value):
            raise ValueError(f"reward_fn returned {value}")
        return VerifyResult(value)
