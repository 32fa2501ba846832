"""The agent's tools: names, argument checking, and observation text. Pure: no sandbox here.

Tools (as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``):

- ``bash {command}``: run a shell command in the workspace (``cd`` persists between calls).
- ``read_file {path}``: a file's text.
- ``write_file {path, content}``: create or overwrite a file.
- ``str_replace {path, old, new}``: replace the one occurrence of ``old`` (``old_str``/``new_str``
  are accepted too); zero or several occurrences is an error and nothing changes.
- ``submit {}``: end the episode; the hidden tests then grade the workspace.

Invariant: ``check_call`` never raises; a bad call gives a ``ToolError`` whose message is the
observation the agent sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.rollout_worker.sandbox import ExecResult
from shared.schemas import ToolCall

# tool -> (required string arguments, optional aliases {alias: canonical})
TOOLS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "bash": (("command",), {"cmd": "command"}),
    "read_file": (("path",), {}),
    "write_file": (("path", "content"), {}),
    "str_replace": (("path", "old", "new"), {"old_str": "old", "new_str": "new"}),
    "submit": ((), {}),
}


@dataclass(frozen=True)
class ToolError:
    message: str


def check_call(call: ToolCall) -> dict[str, str] | ToolError:
    """The call's arguments under their canonical names, or what is wrong with the call."""
    if call.name not in TOOLS:
        return ToolError(f"unknown tool {call.name!r}; the tools are: {', '.join(TOOLS)}")
    required, aliases = TOOLS[call.name]
    args: dict[str, Any] = {}
    for key, value in call.arguments.items():
        name = aliases.get(key, key)
        if name not in required:
            return ToolError(f"{call.name}: unexpected argument {key!r}; it takes {_signature(required)}")
        if name in args:
            return ToolError(f"{call.name}: argument {name!r} given twice")
        args[name] = value
    for name in required:
        if name not in args:
            return ToolError(f"{call.name}: missing argument {name!r}; it takes {_signature(required)}")
        if not isinstance(args[name], str):
            return ToolError(f"{call.name}: argument {name!r} must be a string, got {type(args[name]).__name__}")
    for name in ("path", "command", "old"):
        if name in args and not args[name]:
            return ToolError(f"{call.name}: argument {name!r} must not be empty")
    return args


def _signature(required: tuple[str, ...]) -> str:
    return "{" + ", ".join(required) + "}" if required else "no arguments"


def clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[... truncated: {len(text)} characters, showing the first {limit}]"


def bash_observation(result: ExecResult, timeout_s: float) -> str:
    notes = []
    if result.truncated:
        notes.append(f"[output truncated: the command printed {result.output_bytes} bytes, "
                     f"showing the first {len(result.raw)}]")
    if result.timed_out:
        notes.append(f"[timed out after {timeout_s:g}s; the command was killed]")
    elif result.exit_code is None:
        notes.append("[the command was killed: it printed too much or could not start]")
    else:
        notes.append(f"[exit code {result.exit_code}]")
    output = result.output
    if output and not output.endswith("\n"):
        output += "\n"
    return output + "\n".join(notes)


def replace_once(text: str, old: str, new: str, path: str) -> str | ToolError:
    count = text.count(old)
    if count == 0:
        return ToolError(f"str_replace: 'old' was not found in {path}; nothing changed "
                         "(it must match the file exactly, whitespace included)")
    if count > 1:
        return ToolError(f"str_replace: 'old' occurs {count} times in {path}; nothing changed "
                         "(include more surrounding lines so it occurs exactly once)")
    return text.replace(old, new, 1)
