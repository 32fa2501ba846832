"""The recording proxy against a real vLLM serving the tiny model, called by the real ``openai``
client: what it records is what vLLM sampled, token for token, and sessions do not mix.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import httpx
import openai
import pytest
from agent_support import assert_recorded_as_vllm_sampled, proxy_on_served

from services.rollout_worker.agents.proxy import RecordingLimits

pytestmark = pytest.mark.slow

SERVED = "tiny"
LIMITS = RecordingLimits(max_tokens_per_turn=24, max_episode_tokens=400, max_model_len=1024, max_turns=20)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, served_model):
    with proxy_on_served(served_model, tmp_path_factory.mktemp("proxy")) as server:
        yield server


@pytest.fixture(scope="module")
def vllm(proxy):
    return proxy.vllm


def _open(proxy, trajectory_id, with_socket=False, version=7):
    return proxy.loop.run(proxy.open_session(trajectory_id, LIMITS, lambda: version, with_socket=with_socket))


def test_it_records_exactly_what_vllm_sampled_over_a_multi_turn_conversation(proxy, vllm):
    session = _open(proxy, "traj-a")
    client = openai.OpenAI(base_url=proxy.url, api_key=session.key)
    assert [m.id for m in client.models.list().data] == [SERVED]
    messages = [{"role": "system", "content": "Guess the number."}, {"role": "user", "content": "Your first guess?"}]
    first = client.chat.completions.create(model=SERVED, messages=messages, temperature=0.0, max_tokens=500)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "higher"}]
    # the second call streams, as coding agents do
    stream = client.chat.completions.create(model=SERVED, messages=messages, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(session.turns[1].sampled_token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")

    turns = session.turns
    assert len(turns) == 2 and not turns[1].segment_start
    assert first.choices[0].message.content == turns[0].completion_text and streamed == turns[1].completion_text
    assert_recorded_as_vllm_sampled(vllm.base_url, "traj-a", turns)
    assert all(t.policy_version == 7 for t in turns)
    # the agent's temperature 0 and max_tokens 500 were not used: the rollout's sampling and limits were
    assert all(len(t.sampled_token_ids) <= LIMITS.max_tokens_per_turn for t in turns)
    proxy.loop.run(proxy.close_session(session))
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model=SERVED, messages=messages)


def test_tool_calls_come_back_in_openai_form(proxy):
    session = _open(proxy, "traj-tools")
    tools = [{"type": "function", "function": {"name": "guess", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}}]
    answer = httpx.post(f"{proxy.url}/chat/completions", headers={"Authorization": f"Bearer {session.key}"}, timeout=60,
                        json={"model": SERVED, "messages": [{"role": "user", "content": "guess"}], "tools": tools}).json()
    turn = session.turns[0]
    calls = answer["choices"][0]["message"].get("tool_calls") or []
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [(c.name, c.arguments) for c in turn.tool_calls]
    assert answer["choices"][0]["finish_reason"] == ("tool_calls" if turn.tool_calls else ("length" if turn.finish_reason == "length" else "stop"))
    # the tool schemas reached the model: the tiny template ignores `tools`, so they are in the system message
    assert "<tools>" in proxy.chat.tokenizer.decode(turn.prompt_token_ids) and '"guess"' in proxy.chat.tokenizer.decode(turn.prompt_token_ids)


def _post_over_socket(path: Path, key: str, body: dict) -> tuple[int, dict]:
    transport = httpx.HTTPTransport(uds=str(path))
    with httpx.Client(transport=transport, base_url="http://proxy", timeout=60) as client:
        response = client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        return response.status_code, response.json()


def test_a_sessions_socket_serves_that_session_only(proxy):
    mine, theirs = _open(proxy, "traj-mine", with_socket=True), _open(proxy, "traj-theirs", with_socket=True)
    body = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}]}
    status, answer = _post_over_socket(mine.socket_path, theirs.key, body)
    assert status == 403 and "another trajectory" in answer["error"]["message"]
    assert theirs.turns == [] and mine.turns == []
    status, _ = _post_over_socket(mine.socket_path, mine.key, body)
    assert status == 200 and len(mine.turns) == 1
    status, _ = _post_over_socket(mine.socket_path, "guessed-key", body)
    assert status == 401
    proxy.loop.run(proxy.close_session(mine))
    assert not mine.socket_path.exists()
    with pytest.raises((ConnectionRefusedError, FileNotFoundError)):
        socket.socket(socket.AF_UNIX).connect(str(mine.socket_path))


@pytest.mark.parametrize("body, status, message", [
    ({"messages": "hi"}, 400, "messages must be a non-empty list"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 3}, 400, "n must be 1"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, 400, "max_tokens must be a positive integer"),
    ({"messages": [{"role": "user", "content": "x" * 5000}]}, 400, "context_exhausted"),
])
def test_bad_calls_get_a_400_that_says_why_and_record_nothing(proxy, body, status, message):
    session = _open(proxy, "traj-bad")
    response = httpx.post(f"{proxy.url}/chat/completions", headers={"Authorization": f"Bearer {session.key}"}, json=body, timeout=60)
    assert response.status_code == status and message in response.json()["error"]["message"]
    assert session.turns == [] and session.refused == 1
