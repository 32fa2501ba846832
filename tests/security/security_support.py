"""Shared by the red-team suite: the run label, a sandbox spec maker, a module-shared sandbox, and
the task, and the tool calls of an attack episode (``play``).

The task: ``shop.total(prices)`` returns the sum minus 1 (the bug). The hidden
test adds ``tests/test_total.py::test_total`` (FAIL_TO_PASS); ``test_discount`` already passes."""

from __future__ import annotations

import asyncio
import os
import uuid

from services.rollout_worker.sandbox import Sandbox, SandboxLabels, SandboxSpec
from shared.environments import AgentAction
from shared.schemas import ToolCall

RUNTIME = os.environ.get("SECURITY_SANDBOX_RUNTIME", "runc")  # runsc: gVisor, on the namespaced daemon
RUN_ID = "sectest-" + uuid.uuid4().hex[:8]
SHOP = "def total(prices):\n    return sum(prices) - 1\n\n\ndef discount(price, percent):\n    return price * (100 - percent) / 100\n"
DISCOUNT_TEST = "from shop import discount\n\n\ndef test_discount():\n    assert discount(200, 10) == 180\n"
HIDDEN_TEST = "from shop import total\n\n\ndef test_total():\n    assert total([1, 2, 3]) == 6\n"
F2P = ["tests/test_total.py::test_total"]
P2P = ["tests/test_discount.py::test_discount"]


def spec_for(image: str, name: str, **fields) -> SandboxSpec:
    labels = SandboxLabels(run_id=RUN_ID, group_id="sec", trajectory_id=f"{RUN_ID}_{name}_{uuid.uuid4().hex[:4]}"[:150])
    return SandboxSpec(image=image, labels=labels, **fields)


class SharedSandbox:
    """One sandbox on its own event loop, shared by a module's tests (provisioning once is cheaper)."""

    def __init__(self, spec: SandboxSpec):
        self.loop = asyncio.new_event_loop()
        self.sandbox: Sandbox = self.loop.run_until_complete(Sandbox.provision(spec))

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def exec(self, command: str, **kwargs):
        return self.run(self.sandbox.exec(command, **kwargs))

    def close(self) -> None:
        self.loop.run_until_complete(self.sandbox.teardown())
        self.loop.close()


def write(path: str, content: str) -> ToolCall:
    return ToolCall(name="write_file", arguments={"path": path, "content": content})


def bash(command: str) -> ToolCall:
    return ToolCall(name="bash", arguments={"command": command})


def shlex_quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def prepend_to_shop(code: str) -> ToolCall:
    return bash(f"printf '%s\\n' {shlex_quote(code)} | cat - shop/__init__.py > /tmp/s && cp /tmp/s shop/__init__.py")


async def play(env, task: dict, calls: list[ToolCall]):
    """One episode: reset, the tool calls, submit, verify; the env is closed either way."""
    observations = []
    try:
        await env.reset(task, seed=0)
        for tool_call in [*calls, ToolCall(name="submit")]:
            result = await env.step(AgentAction("", [tool_call], None))
            observations.append(result.observation)
        verdict = await env.verify()
    finally:
        await env.close()
    return observations, verdict
