"""Guess-the-number: a deterministic, verifiable multi-turn text game with tool calls.

The agent calls ``guess`` with an integer; the game answers "higher", "lower" or "correct".
Task data: ``{"target": int, "low": int, "high": int}``. The verifier's reward is 1.0 for a
solved game, otherwise up to 0.5 for how close the best valid guess came (0 without one), so
partial progress is visible to GRPO.
"""

from __future__ import annotations

from typing import Any

from shared.environments import AgentAction, Environment, RowRejected, StepResult, VerifyResult

SYSTEM_PROMPT = (
    "You are playing a number guessing game. To guess, call the tool: "
    '<tool_call>{"name": "guess", "arguments": {"number": N}}</tool_call>. '
    "After each guess you are told higher, lower or correct."
)


def _require_int(data: dict[str, Any], field: str) -> int:
    value = data.get(field)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RowRejected(f"field {field!r} must be an integer, got {value!r}")
    return value


class GuessNumberEnv(Environment):
    name = "guess_number"

    @classmethod
    def task_from_row(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Flat ``target``/``low``/``high`` fields, target within the range."""
        low, high, target = (_require_int(data, f) for f in ("low", "high", "target"))
        if not low <= target <= high:
            raise RowRejected(f"target {target} is outside [{low}, {high}]")
        return {"low": low, "high": high, "target": target}

    async def reset(self, task_data: dict[str, Any], seed: int) -> list[dict[str, str]]:
        self.low, self.high, self.target = int(task_data["low"]), int(task_data["high"]), int(task_data["target"])
        self.guesses: list[int] = []
        self.solved = False
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"I am thinking of a number between {self.low} and {self.high}. Guess it."},
        ]

    async def step(self, action: AgentAction) -> StepResult:
        await self.simulate_tool_latency()
        if action.tool_call_error:
            return StepResult(f"Error: {action.tool_call_error}. Try again.", done=False, info={"invalid": True})
        guesses = [c for c in action.tool_calls if c.name == "guess"]
        if not guesses:
            return StepResult('Error: no guess. Call the "guess" tool with a number.', done=False, info={"invalid": True})
        number = guesses[0].arguments.get("number")
        if isinstance(number, bool) or not isinstance(number, int):
            return StepResult('Error: "number" must be an integer.', done=False, info={"invalid": True})
        self.guesses.append(number)
        if number == self.target:
            self.solved = True
            return StepResult("correct", done=True, reward=1.0)
        return StepResult("higher" if number < self.target else "lower", done=False)

    async def verify(self) -> VerifyResult:
        if self.solved:
            return VerifyResult(1.0, {"solved": True, "guesses": len(self.guesses)})
        if not self.guesses:
            return VerifyResult(0.0, {"solved": False, "guesses": 0})
        span = max(1, self.high - self.low)
        best = min(abs(g - self.target) for g in self.guesses)
        return VerifyResult(0.5 * max(0.0, 1 - best / span), {"solved": False, "guesses": len(self.guesses)})
