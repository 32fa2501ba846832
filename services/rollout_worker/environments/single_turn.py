"""Single-turn tasks defined by data plus a reward function: how users bring their own
verifiable tasks with no code change in Conveyor.

Task data: ``{"prompt": str, "row": {...the dataset row...}}``. Environment config
(``SingleTurnConfig``): ``reward_fn`` is an import path ``module:function``; the function takes
the completion text and the row and returns a number. The verifier's reward is that number.

Invariant: a reward function that cannot be imported is refused at intake (``check_task``) and
when the worker builds the environment; one that raises or returns a non-number is an
environment error naming the function (the trajectory fails with the reason), never a silent
reward of 0.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Callable

from pydantic import Field

from shared.environments import AgentAction, EnvConfig, Environment, RowRejected, StepResult, VerifyResult
from shared.import_path import ImportPathError, import_callable


@lru_cache(maxsize=32)
def import_reward_fn(path: str) -> Callable[[str, dict[str, Any]], float]:
    return import_callable(path, "reward_fn")


class SingleTurnConfig(EnvConfig):
    reward_fn: str | None = Field(None, description="module:function scoring (completion, row)")
    system_prompt: str | None = None


class SingleTurnEnv(Environment):
    name = "single_turn"
    Config = SingleTurnConfig
    config: SingleTurnConfig

    @classmethod
    def task_from_row(cls, data: dict[str, Any]) -> dict[str, Any]:
        prompt = data.get("prompt") or data.get("question")
        if not isinstance(prompt, str) or not prompt.strip():
            raise RowRejected("field 'prompt' (or 'question') must be a non-empty string")
        return {"prompt": prompt, "row": data}

    @classmethod
    def check_task(cls, task_data: dict[str, Any], config: SingleTurnConfig) -> dict[str, Any]:
        """Rejects a row whose ``reward_fn`` is missing or cannot be imported: every episode of
        it would fail, with the reason only in the ledger."""
        if config.reward_fn is None:
            raise RowRejected("env_config.reward_fn is missing: single_turn rows are scored by it")
        try:
            import_callable(config.reward_fn, "env_config.reward_fn")
        except ImportPathError as exc:
            raise RowRejected(str(exc)) from None
        return task_data

    async def reset(self, task_data: dict[str, Any], seed: int) -> list[dict[str, str]]:
        self.row = dict(task_data.get("row") or {})
        self.reply = ""
        self.reward_fn = import_reward_fn(str(self.config.reward_fn or ""))
        messages = [{"role": "user", "content": str(task_data["prompt"])}]
        if self.config.system_prompt:
            messages.insert(0, {"role": "system", "content": self.config.system_prompt})
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
