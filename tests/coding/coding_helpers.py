"""Shared by the coding tests: the fixture repository's files and a scripted episode loop."""

from __future__ import annotations

import json

from shared.environments import AgentAction
from services.rollout_worker.environments.coding import CodingEnv
from services.rollout_worker.tool_calls import parse_tool_calls

CALC = '''\
def add(a, b):
    return a - b


def sub(a, b):
    return a - b


def mul(a, b):
    return a + b
'''
EXISTING_TEST = '''\
from calc import sub


def test_sub():
    assert sub(5, 3) == 2
'''
HIDDEN_TEST = '''\
from calc import add, mul


def test_add():
    assert add(2, 3) == 5


def test_mul():
    assert mul(2, 3) == 6
'''
F2P = ["tests/test_calc.py::test_add", "tests/test_calc.py::test_mul"]
P2P = ["tests/test_existing.py::test_sub"]


def action(text: str) -> AgentAction:
    calls, error = parse_tool_calls(text)
    return AgentAction(text, calls, error)


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


async def run_scripted(env: CodingEnv, task_data: dict, script: list[str]):
    """The episode loop without a model: reset, one scripted reply per turn, verify, close."""
    observations = []
    try:
        messages = await env.reset(task_data, seed=0)
        for text in script:
            result = await env.step(action(text))
            observations.append(result.observation)
            if result.done:
                break
        verdict = await env.verify()
    finally:
        await env.close()
    return messages, observations, verdict
