"""OpenAI chat messages as the policy's chat template sees them, and as the proxy compares them.

Invariants:
- ``template_message`` is what the template renders: text content (a list of parts becomes its
  text parts joined), tool-call arguments as objects. Anything else an OpenAI client sends along
  (ids, refusal, annotations) is not rendered.
- ``message_key`` is equal for two messages exactly when the template would render them alike
  (role, text, name, tool-call names and arguments), so an agent that echoes the proxy's own
  reply back with cosmetic differences (``content: null`` next to tool calls, re-serialized
  arguments) still extends its sequence.
- Bad input raises ``BadChatRequest`` naming the message and what is wrong with it; the server
  answers it with HTTP 400 and nothing is recorded.
- Tools: a template that renders ``tools`` gets them; for one that does not, the tool schemas go
  into the system message in the hermes format the proxy parses replies in
  (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``).
"""

from __future__ import annotations

import json
from typing import Any

from services.rollout_worker.tool_calls import CLOSE, OPEN

ROLES = ("system", "developer", "user", "assistant", "tool")


class BadChatRequest(ValueError):
    pass


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for number, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text") and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadChatRequest(f"{where}: content part {number} of type {kind!r} is not text (the policy reads text only)")
        return "".join(parts)
    raise BadChatRequest(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if raw in (None, ""):
        return {}
    if isinstance(raw, str):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise BadChatRequest(f"{where}: arguments are not JSON ({exc.msg})") from None
        if isinstance(value, dict):
            return value
    raise BadChatRequest(f"{where}: arguments must be a JSON object")


def template_message(message: Any, number: int) -> dict[str, Any]:
    where = f"messages[{number}]"
    if not isinstance(message, dict):
        raise BadChatRequest(f"{where} must be an object, got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise BadChatRequest(f"{where}: role {role!r} is not one of {', '.join(ROLES)}")
    rendered: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                "content": _text(message.get("content"), where)}
    if isinstance(message.get("name"), str):
        rendered["name"] = message["name"]
    if role == "tool" and isinstance(message.get("tool_call_id"), str):
        rendered["tool_call_id"] = message["tool_call_id"]
    calls = message.get("tool_calls") or []
    if role == "assistant" and calls:
        if not isinstance(calls, list):
            raise BadChatRequest(f"{where}: tool_calls must be a list")
        rendered["tool_calls"] = []
        for index, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise BadChatRequest(f"{where}.tool_calls[{index}] needs a function with a string name")
            rendered["tool_calls"].append({
                "type": "function", "id": call.get("id", ""),
                "function": {"name": function["name"], "arguments": _arguments(function.get("arguments"), f"{where}.tool_calls[{index}]")},
            })
    return rendered


def template_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise BadChatRequest("messages must be a non-empty list")
    return [template_message(m, i) for i, m in enumerate(messages)]


def message_key(message: dict[str, Any]) -> str:
    """Equal for messages the template renders alike (ids of tool calls do not count)."""
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    return json.dumps([message["role"], message["content"].strip(), message.get("name"), calls], sort_keys=True)


def check_tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise BadChatRequest("tools must be a list")
    for number, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadChatRequest(f"tools[{number}] needs a function with a string name")
    return tools


def with_tools_in_system(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For templates that ignore ``tools``: the schemas and the call format in the system message."""
    if not tools:
        return messages
    schemas = "\n".join(json.dumps(t["function"], sort_keys=True) for t in tools)
    text = (f"You may call these tools. Their JSON schemas:\n<tools>\n{schemas}\n</tools>\n"
            f"To call one, write {OPEN}{{\"name\": <name>, \"arguments\": <object>}}{CLOSE}.")
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
