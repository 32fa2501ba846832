"""Tool use against an MCP server: the agent calls the server's tools, a verifier scores the end.

The environment connects to one MCP server per episode, over stdio (``env_config.command``: the
server is started for the episode and stopped with it) or streamable HTTP (``env_config.url``).
``reset`` lists the server's tools (``env_config.tools`` narrows them), renders their names,
descriptions and input schemas into the system prompt, and gives the task's prompt. Each turn:

- tool calls in the reply (Hermes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``)
  are executed in order, and their results are the observation;
- a reply with no tool call, or one holding ``done_marker``, is the agent's final answer and
  ends the episode.

The reward, at ``verify``: ``env_config.verifier_tool`` (a tool of the server, called with
``task_data.verifier_args``, whose text is the reward), else ``env_config.reward_fn``
(``module:function`` called with ``(task_data, final_answer, tool_log)``), else 1.0 when
``task_data.answer`` appears in the final answer.

Invariants:
- Bad model output never raises: a malformed call, an unknown or disallowed tool, arguments
  the server rejects, or a tool that fails are error observations.
- A server that cannot be reached or started, or that breaks mid-episode, is an environment
  error naming the server; the episode's connection (and a stdio server's process) is closed
  by ``close`` whatever happened.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from contextlib import AsyncExitStack
from typing import Any, cast

from pydantic import Field, model_validator

from shared.environments import (AgentAction, EnvConfig, Environment, EnvironmentError_, RowRejected, StepResult,
                                 VerifyResult)
from shared.import_path import import_callable

TOOL_PROMPT = (
    "You can use these tools:\n<tools>\n{tools}\n</tools>\n"
    'To call a tool, write <tool_call>{{"name": "TOOL", "arguments": {{...}}}}</tool_call>. '
    "When you have the final answer, reply with it and no tool call."
)
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


class McpConfig(EnvConfig):
    url: str | None = None  # streamable HTTP endpoint, e.g. http://host:8000/mcp
    command: list[str] | None = None  # a stdio server: argv, started per episode
    # a stdio server gets the MCP SDK's safe default environment (PATH, HOME, ...) plus these
    server_env: dict[str, str] = Field(default_factory=dict)
    tools: list[str] | None = None  # the tools the agent may use (default: all the server lists)
    system_prompt: str | None = None  # put before the tool list
    done_marker: str = "<done>"
    verifier_tool: str | None = None
    reward_fn: str | None = None
    call_timeout_s: float = Field(60.0, gt=0)

    @model_validator(mode="after")
    def _one_server(self) -> "McpConfig":
        if (self.url is None) == (self.command is None):
            raise ValueError("give exactly one of url (streamable HTTP) and command (stdio)")
        if self.command is not None and not self.command:
            raise ValueError("command must name the server's program")
        return self


class McpToolEnv(Environment):
    name = "mcp"
    Config = McpConfig
    config: McpConfig

    @classmethod
    def task_from_row(cls, data: dict[str, Any]) -> dict[str, Any]:
        prompt = data.get("prompt") or data.get("question")
        if not isinstance(prompt, str) or not prompt.strip():
            raise RowRejected("field 'prompt' (or 'question') must be a non-empty string")
        task: dict[str, Any] = {"prompt": prompt}
        if data.get("answer") not in (None, ""):
            task["answer"] = str(data["answer"])
        if "verifier_args" in data:
            if not isinstance(data["verifier_args"], dict):
                raise RowRejected("field 'verifier_args' must be an object")
            task["verifier_args"] = data["verifier_args"]
        return task

    @classmethod
    def check_task(cls, task_data: dict[str, Any], config: McpConfig) -> dict[str, Any]:
        if config.verifier_tool is None and config.reward_fn is None and "answer" not in task_data:
            raise RowRejected("nothing can score this row: give it an 'answer', or set env_config.verifier_tool "
                              "or env_config.reward_fn")
        if config.reward_fn is not None:
            import_callable(config.reward_fn, "env_config.reward_fn")
        return task_data

    def _server_name(self) -> str:
        return self.config.url or " ".join(self.config.command or [])

    async def reset(self, task_data: dict[str, Any], seed: int) -> list[dict[str, str]]:
        from mcp import Client
        from mcp.client.stdio import StdioServerParameters, stdio_client

        self.task = task_data
        self.final_answer: str | None = None
        self.tool_log: list[dict[str, Any]] = []
        self._stack: AsyncExitStack | None = AsyncExitStack()
        # a stdio server's stderr goes to a file of the episode (a worker's sys.stderr may be no file)
        self._server_log = self._stack.enter_context(tempfile.TemporaryFile("w+", prefix="conveyor-mcp-"))
        if self.config.url is not None:
            server: Any = self.config.url
        else:
            program, *args = cast(list[str], self.config.command)  # McpConfig holds a url or a command
            server = stdio_client(StdioServerParameters(command=program, args=args, env=self.config.server_env or None),
                                  errlog=self._server_log)
        try:
            self.client = await self._stack.enter_async_context(
                Client(server, read_timeout_seconds=self.config.call_timeout_s))
            listed = (await self.client.list_tools()).tools
        except Exception as exc:  # the server is the environment: it failed, not the agent
            raise EnvironmentError_(f"MCP server {self._server_name()} is unusable: {type(exc).__name__}: {exc}"
                                    f"{self._server_stderr()}") from exc
        allowed = set(self.config.tools) if self.config.tools is not None else None
        hidden = {self.config.verifier_tool}  # the verifier is the grader's, never the agent's
        self.tools = {t.name: t for t in listed if (allowed is None or t.name in allowed) and t.name not in hidden}
        missing = sorted((allowed or set()) - set(self.tools))
        if missing:
            raise EnvironmentError_(f"MCP server {self._server_name()} has no tool(s) {missing}")
        described = "\n".join(json.dumps({"name": t.name, "description": t.description or "",
                                          "parameters": t.input_schema}) for t in self.tools.values())
        system = TOOL_PROMPT.format(tools=described)
        if self.config.system_prompt:
            system = self.config.system_prompt + "\n\n" + system
        return [{"role": "system", "content": system}, {"role": "user", "content": task_data["prompt"]}]

    def _server_stderr(self) -> str:
        self._server_log.seek(0)
        tail = self._server_log.read()[-1000:].strip()
        return f"; its stderr: {tail}" if tail else ""

    async def step(self, action: AgentAction) -> StepResult:
        await self.simulate_tool_latency()
        if action.tool_call_error:
            return StepResult(f"Error: {action.tool_call_error}. Try again.", done=False, info={"invalid": True})
        if not action.tool_calls or self.config.done_marker in action.text:
            self.final_answer = action.text.replace(self.config.done_marker, "").strip()
            return StepResult("", done=True)
        results = [await self._call(call.name, call.arguments) for call in action.tool_calls]
        return StepResult("\n".join(text for text, _ in results), done=False,
                          info={"tool_calls": len(results), "tool_errors": sum(1 for _, ok in results if not ok)})

    async def _call(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """The agent's call: only the tools it was shown."""
        if name not in self.tools:
            return f"Error: no tool {name!r}; the tools are {sorted(self.tools)}", False
        return await self._invoke(name, arguments)

    async def _invoke(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        try:
            result = await self.client.call_tool(name, arguments)
        except Exception as exc:
            raise EnvironmentError_(f"MCP server {self._server_name()} failed calling {name}: "
                                    f"{type(exc).__name__}: {exc}{self._server_stderr()}") from exc
        text = "\n".join(getattr(part, "text", "") or "" for part in result.content)
        self.tool_log.append({"name": name, "arguments": arguments, "result": text[:2000], "error": bool(result.is_error)})
        if result.is_error:
            return f"Error from {name}: {text}", False
        return f"{name} returned: {text}", True

    async def verify(self) -> VerifyResult:
        answer = self.final_answer or ""
        info = {"tool_calls": len(self.tool_log), "answered": self.final_answer is not None}
        if self.config.verifier_tool is not None:
            text, ok = await self._invoke(self.config.verifier_tool, dict(self.task.get("verifier_args") or {}))
            numbers = _NUMBER.findall(text.split("returned:", 1)[-1]) if ok else []
            if not numbers:
                raise EnvironmentError_(f"verifier tool {self.config.verifier_tool} gave no reward: {text[:200]}")
            return VerifyResult(float(numbers[0]), info)
        if self.config.reward_fn is not None:
            value = float(import_callable(self.config.reward_fn, "env_config.reward_fn")(self.task, answer, self.tool_log))
            if not math.isfinite(value):
                raise ValueError(f"reward_fn returned {value}")
            return VerifyResult(value, info)
        hit = " ".join(self.task["answer"].lower().split()) in " ".join(answer.lower().split())
        return VerifyResult(1.0 if hit and self.final_answer is not None else 0.0, {**info, "correct": hit})

    async def close(self) -> None:
        stack = getattr(self, "_stack", None)
        if stack is not None:
            self._stack = None
            await stack.aclose()
