"""One trajectory's model calls, recorded as turns while an agent makes them.

Invariants:
- A call whose messages extend the previous call's messages plus the reply the proxy gave
  (compared with ``messages.message_key``) continues the same sequence: its prompt is the
  previous context (prompt ids + sampled ids, never re-tokenized) plus the ids of the new
  messages only, rendered by the policy's chat template after an assistant turn. Its turn's
  ``prompt_token_ids`` are those new ids.
- Any other call (the agent compacted or cut its history, changed its tools, or asked the same
  thing again) starts a new segment: the whole conversation is rendered afresh, and its turn
  has ``segment_start`` (``Trajectory.segments``). Nothing sampled is lost either way.
- Every sampled id is recorded with the logprob vLLM returned and the policy version read just
  before the call; the loss mask (``Trajectory.flatten``) covers exactly these ids.
- Sampling is the rollout's, not the agent's: the agent's temperature and top_p are not used,
  each call's seed is ``turn_seed(trajectory, turn)``, and ``max_tokens`` can only lower the
  per-turn limit. A call past the episode's token budget or the model's context raises
  ``BudgetExhausted`` and records nothing; the recording keeps the stop reason, and every later
  call is refused with it too (a smaller prompt after the stop is not a turn).
- ``prompt_keys``: the prompt-cache keys of the initial prompts this recording rendered
  (``ChatTokens.forget`` them when the session ends).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from services.rollout_worker.chat_tokens import ChatTokens
from services.rollout_worker.agents.proxy.messages import message_key, with_tools_in_system
from services.rollout_worker.inference_client import Completion
from services.rollout_worker.tool_calls import parse_tool_calls, without_tool_calls
from shared.schemas import StopReason, ToolCall, Turn, TurnTimings

class BudgetExhausted(RuntimeError):
    def __init__(self, reason: StopReason, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class RecordingLimits:
    max_tokens_per_turn: int
    max_episode_tokens: int
    max_model_len: int
    max_turns: int


@dataclass(frozen=True)
class PendingCall:
    """A call's prompt, decided before it goes to vLLM."""

    context: list[int]  # the whole prompt sent
    new_ids: list[int]  # what this call appended (the turn's prompt_token_ids)
    segment_start: bool
    max_tokens: int
    keys: list[str]  # the call's messages, compared next time
    observation: str  # the new messages' text, kept as the previous turn's observation
    policy_version: int
    started: float


@dataclass(frozen=True)
class Reply:
    text: str  # the sampled text with tool-call blocks removed
    tool_calls: list[ToolCall]
    tool_call_error: str | None
    finish_reason: str  # OpenAI's: stop, length or tool_calls
    turn: Turn


class AgentRecording:
    def __init__(self, chat: ChatTokens, limits: RecordingLimits):
        self.chat = chat
        self.limits = limits
        self.turns: list[Turn] = []
        self.exhausted: StopReason | None = None
        self._keys: list[str] = []  # the messages the context holds, the last reply included
        self._context: list[int] = []
        self._tools_key = ""
        self._ended_with_eos = False
        self._sampled_total = 0
        self.prompt_keys: set[str] = set()

    # --- before the call -------------------------------------------------------------------
    def prepare(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], requested_max_tokens: int | None,
                policy_version: int) -> PendingCall:
        """``policy_version``: the served version, read just before the call."""
        if self.exhausted is not None:
            raise BudgetExhausted(self.exhausted, f"the episode was stopped ({self.exhausted.value}): no call is taken after the stop")
        if len(self.turns) >= self.limits.max_turns:
            self._exhaust(StopReason.max_turns, f"the episode's {self.limits.max_turns} model calls are used up")
        keys = [message_key(m) for m in messages]
        tools_key = repr(tools)
        extends = (self._keys and tools_key == self._tools_key and len(keys) > len(self._keys)
                   and keys[:len(self._keys)] == self._keys)
        observation = ""
        if extends:
            delta = messages[len(self._keys):]
            new_ids = self.chat.ids_after_assistant(delta, self._ended_with_eos, tools if self.chat.renders_tools else None)
            context = self._context + new_ids
            observation = "\n".join(str(m["content"]) for m in delta)
        else:
            new_ids = (self.chat.initial_prompt(messages, tools, keys=self.prompt_keys) if self.chat.renders_tools
                       else self.chat.initial_prompt(with_tools_in_system(messages, tools), keys=self.prompt_keys))
            context = new_ids
        budget, reason = self._budget(len(context), requested_max_tokens)
        if budget <= 0:
            self._exhaust(reason, f"no tokens left for this call ({reason.value}: context {len(context)} of "
                                  f"{self.limits.max_model_len}, {self._sampled_total} of {self.limits.max_episode_tokens} sampled)")
        return PendingCall(context, new_ids, segment_start=not extends and bool(self.turns), max_tokens=budget, keys=keys,
                           observation=observation, policy_version=policy_version, started=time.perf_counter())

    def _budget(self, context_len: int, requested: int | None) -> tuple[int, StopReason]:
        per_turn = self.limits.max_tokens_per_turn if requested is None else min(requested, self.limits.max_tokens_per_turn)
        episode_left = self.limits.max_episode_tokens - self._sampled_total
        context_left = self.limits.max_model_len - context_len
        if context_left < min(per_turn, episode_left):
            return context_left, StopReason.context_exhausted
        return min(per_turn, episode_left), StopReason.max_tokens

    def _exhaust(self, reason: StopReason, detail: str) -> None:
        self.exhausted = reason
        raise BudgetExhausted(reason, detail)

    # --- after the call --------------------------------------------------------------------
    def record(self, call: PendingCall, completion: Completion, tools: list[dict[str, Any]]) -> Reply:
        text = self.chat.decode(completion.token_ids)
        calls, call_error = parse_tool_calls(text) if tools else ([], None)
        if self.turns and not call.segment_start and call.observation:
            self.turns[-1] = self.turns[-1].model_copy(update={"observation": call.observation})
        turn = Turn(
            index=len(self.turns), prompt_token_ids=call.new_ids, sampled_token_ids=completion.token_ids,
            logprobs=completion.logprobs, policy_version=call.policy_version, finish_reason=completion.finish_reason,
            completion_text=text, tool_calls=calls, tool_call_error=call_error, segment_start=call.segment_start,
            timings=TurnTimings(inference_s=time.perf_counter() - call.started - completion.outage_wait_s),
        )
        self.turns.append(turn)
        self._sampled_total += len(completion.token_ids)
        self._context = call.context + completion.token_ids
        self._ended_with_eos = bool(completion.token_ids) and completion.token_ids[-1] == self.chat.eos_token_id
        content = without_tool_calls(text) if calls else text
        reply_message = {"role": "assistant", "content": content,
                         "tool_calls": [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls]}
        self._keys = call.keys + [message_key(reply_message)]
        self._tools_key = repr(tools)
        finish = "tool_calls" if calls else ("length" if completion.finish_reason == "length" else "stop")
        return Reply(content, calls, call_error, finish, turn)

