"""Parse tool calls from model output: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Invariant: parsing never raises (``tests/unit/test_tool_calls_fuzz.py`` holds it to that).
Malformed output yields an error message that says what was wrong, which the environment turns
into an observation for the agent: JSON that Python will not read (an integer of more than
4300 digits, nesting deeper than the recursion limit) is malformed output too.
A ``</tool_call>`` cannot appear inside a call: it ends the call.
"""

from __future__ import annotations

import json
import re

from pydantic import ValidationError

from shared.json_errors import json_problem
from shared.schemas import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


def parse_tool_calls(text: str) -> tuple[list[ToolCall], str | None]:
    """Returns (calls, error). No tool call at all is (``[]``, None)."""
    calls: list[ToolCall] = []
    for number, body in enumerate(_BLOCK.findall(text), start=1):
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as exc:
            return calls, f"tool call {number} is not valid JSON ({json_problem(exc)})"
        except ValueError as exc:  # valid JSON Python will not read: a number of too many digits
            return calls, f"tool call {number} cannot be read: {exc}"
        except RecursionError:
            return calls, f"tool call {number} cannot be read: nested too deeply"
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return calls, f'tool call {number} needs an object with a string "name"'
        try:
            calls.append(ToolCall(name=payload["name"], arguments=payload.get("arguments") or {}))
        except ValidationError:
            return calls, f'tool call {number}: "arguments" must be an object'
    unclosed = _BLOCK.sub("", text).count(OPEN)  # outside the calls read (an argument may hold the tag)
    if unclosed > 0:
        return calls, f"{unclosed} tool call(s) opened with {OPEN} but never closed with {CLOSE}"
    return calls, None


def without_tool_calls(text: str) -> str:
    """``text`` with every complete tool-call block taken out: what a chat API returns as content."""
    return _BLOCK.sub("", text).strip()
