"""A rollout worker's inference servers (``services.rollout_worker.inference_targets``): a request
that names no server gets the worker's own; a run's own server (``RolloutRequest.inference``, which
intake sets from ``inference.own_server``) gets one client and one tokenizer for the process, its
tokenizer loaded once however many episodes ask at once; a tokenizer that cannot be loaded fails
that request with an error naming the run, the server and the path, and the next request tries
again. The tokenizers are real (the tiny model's). That an agent-driven episode of such a run calls
its run's server too is ``tests/agents/test_agent_run_server.py`` (the real proxy and vLLM)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from services.inference.tiny_model import generate_tiny_model
from services.intake.publisher import build_group
from services.rollout_worker.chat_tokens import load_chat_tokens
from services.rollout_worker.inference_client import InferenceClient
from services.rollout_worker.inference_targets import InferenceTargetError, RunServers, Served
from shared.schemas import InferenceTarget, RolloutRequest, TaskProfile
from shared.settings import Settings


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return generate_tiny_model(tmp_path_factory.mktemp("targets") / "tiny")


def _settings(tiny_model: Path, own_server: bool, url: str = "http://10.1.2.3:8123") -> Settings:
    return Settings(run_id="mine", inference={"own_server": own_server, "base_url": url, "model": "mine-served",
                                              "model_path": str(tiny_model), "max_model_len": 512})


def _requests(settings: Settings, group_id: int = 0):
    return build_group(settings, group_id, TaskProfile(task_id="t", env_name="guess_number", task_data={}))


def test_intake_names_the_runs_own_server_only_when_it_has_one(tiny_model):
    [target] = {r.inference for r in _requests(_settings(tiny_model, own_server=True))}
    assert target == InferenceTarget(base_url="http://10.1.2.3:8123", model="mine-served", model_path=str(tiny_model),
                                     max_model_len=512, lora_adapters=False)
    shared = _requests(_settings(tiny_model, own_server=False))
    assert {r.inference for r in shared} == {None}
    # left out when None: a worker of the build before, which forbids unknown fields, reads it
    assert "inference" not in json.loads(shared[0].model_dump_json())
    assert RolloutRequest.model_validate_json(shared[0].model_dump_json()) == shared[0]
    own = _requests(_settings(tiny_model, own_server=True))[0]
    assert RolloutRequest.model_validate_json(own.model_dump_json()) == own


def test_one_client_and_one_tokenizer_per_server_and_the_workers_own_for_the_rest(tiny_model):
    loads: list[str] = []

    def load_chat(path: str):
        loads.append(path)
        return load_chat_tokens(path)

    async def scenario():
        servers = RunServers(lambda t: InferenceClient(t.base_url, t.model), load_chat)
        own = Served(InferenceClient("http://127.0.0.1:1", "tiny"), load_chat_tokens(tiny_model), 1024)
        mine = _requests(_settings(tiny_model, own_server=True))
        other = _requests(_settings(tiny_model, own_server=True, url="http://10.9.9.9:8000"), group_id=1)
        shared = _requests(_settings(tiny_model, own_server=False))
        # every member of two groups at once, and the stack's run's
        served = await asyncio.gather(*(servers.for_request(r, own) for r in mine + other + shared))
        return own, served, len(mine), len(other)

    own, served, n_mine, n_other = asyncio.run(scenario())
    mine, other, shared = served[:n_mine], served[n_mine:n_mine + n_other], served[n_mine + n_other:]
    assert all(s is mine[0] for s in mine) and all(s is other[0] for s in other) and mine[0] is not other[0]
    assert (mine[0].client.base_url, mine[0].client.model, mine[0].max_model_len) == ("http://10.1.2.3:8123", "mine-served", 512)
    assert other[0].client.base_url == "http://10.9.9.9:8000"
    assert all(s is own for s in shared)
    assert loads == [str(tiny_model), str(tiny_model)]  # once per server, not per episode


def test_a_runs_server_gets_the_workers_request_and_outage_settings(tiny_model):
    settings = Settings(inference={"request_timeout_s": 7, "max_retries": 5}, outage={"limit_s": 42})
    [request, *_] = _requests(_settings(tiny_model, own_server=True))
    client = RunServers.from_settings(settings).make_client(request.inference)
    assert (client.base_url, client.model, client.timeout_s, client.max_retries) == ("http://10.1.2.3:8123", "mine-served", 7, 5)
    assert client.gate.outage.limit_s == 42


def test_a_tokenizer_that_cannot_be_loaded_fails_that_request_and_the_next_tries_again(tiny_model, tmp_path):
    missing = tmp_path / "not-on-this-worker"
    loads: list[str] = []

    def load_chat(path: str):
        loads.append(path)
        return load_chat_tokens(path)

    settings = _settings(tiny_model, own_server=True).model_copy(deep=True)
    settings.inference.model_path = str(missing)
    [request, *_] = _requests(settings)
    servers = RunServers(lambda t: InferenceClient(t.base_url, t.model), load_chat)
    own = Served(InferenceClient("http://127.0.0.1:1", "tiny"), load_chat_tokens(tiny_model), 1024)
    for _ in range(2):
        with pytest.raises(InferenceTargetError) as failed:
            asyncio.run(servers.for_request(request, own))
        assert f"run mine's inference server http://10.1.2.3:8123: its tokenizer at '{missing}'" in str(failed.value)
    assert loads == [str(missing)] * 2

