"""Single-turn question answering: the agent answers once; reward 1.0 if the expected answer
appears in the reply (case- and whitespace-insensitive), else 0.0."""

from __future__ import annotations

from typing import Any

from shared.environments import AgentAction, Environment, RowRejected, StepResult, VerifyResult


def _normalize(text: str) -> str:
    return " ".join(text.lower().split())


class QuestionAnswerEnv(Environment):
    name = "qa"

    @classmethod
    def task_from_row(cls, data: dict[str, Any]) -> dict[str, Any]:
        """``question`` (or ``prompt``) and ``answer``."""
        question = data.get("question") or data.get("prompt")
        if not isinstance(question, str) or not question.strip():
            raise RowRejected("field 'question' (or 'prompt') must be a non-empty string")
        if data.get("answer") in (None, ""):
            raise RowRejected("field 'answer' is missing")
        return {"question": question, "answer": str(data["answer"])}

    async def reset(self, task_data: dict[str, Any], seed: int) -> list[dict[str, str]]:
        self.answer = str(task_data["answer"])
        self.reply = ""
        return [{"role": "user", "content": str(task_data["question"])}]

    async def step(self, action: AgentAction) -> StepResult:
        self.reply = action.text
        return StepResult("", done=True)

    async def verify(self) -> VerifyResult:
        hit = _normalize(self.answer) in _normalize(self.reply)
        return VerifyResult(1.0 if hit else 0.0, {"correct": hit})
