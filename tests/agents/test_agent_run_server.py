"""An agent-driven episode of a run with an inference server of its own (``RolloutRequest.inference``)
calls THAT server, through the real runner (``run_requests``), the real recording proxy and the
real ledger on Redis; the session's vLLM stands as the run's server while the worker's own
``inference`` points where nothing listens, under another served name:

- every turn is what the run's server sampled (each sent again straight to it with its seed
  gives the same ids and logprobs), with the run's policy version; the agent was told the run's
  served name; the run's tokenizer was loaded once, from the run's model path; the worker's own
  server was never called (its outage switch never moved);
- a run's server that is down fails that run's agent-driven episode as ``inference_outage``
  naming the server, and never switches the worker's taking of tasks off.

The agent is a test plugin that runs in the worker's process and calls its session's socket
(what the sandbox's forwarder connects to, ``agents.proxy.forward``) over HTTP; the sandbox around
an agent is ``tests/coding/test_agent_coding.py``'s.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from agent_support import assert_recorded_as_vllm_sampled

from services.cli.local_stack import free_port
from services.rollout_worker.chat_tokens import load_chat_tokens
from services.rollout_worker.environments.agent_coding import AgentEndpoint, AgentRun
from services.rollout_worker.inference_client import InferenceClient
from services.rollout_worker.inference_targets import RunServers
from services.rollout_worker.runner import RolloutContext, run_requests
from services.rollout_worker.scoring_outbox import ScoringOutbox
from shared import ids
from shared.environments import Environment, VerifyResult
from shared.outcomes import kind_of
from shared.schemas import InferenceTarget, RolloutRequest, TaskProfile
from shared.settings import load_settings
from shared.state.leases import LeaseKeeper
from shared.state.ledger import Ledger
from shared.state.policy_version import PolicyVersion
from shared.storage import LocalStore
from shared.trajectory_lookup import find_trajectory

pytestmark = pytest.mark.slow

WORKER_SERVED = "worker-own"  # the worker's own server's name; nothing listens at its URL
RUN_SERVED = "tiny"  # the session vLLM's, standing as the run's own server


class ChattingAgentEnv(Environment):
    """An agent-driven environment whose agent asks the model twice over its session's socket (the
    second call extends the first with the reply and a user turn), stopping at a failed call, and
    keeps what it was told by trajectory id."""

    name = "test_agent_chats"
    told: dict[str, dict] = {}

    def bind_trajectory(self, *, run_id: str, group_id: int, trajectory_id: str) -> None:
        self.trajectory_id = trajectory_id

    def attach_agent(self, endpoint: AgentEndpoint) -> None:
        self.endpoint = endpoint

    async def reset(self, task_data, seed):  # noqa: ANN001, ANN201
        return [{"role": "user", "content": "Guess the number."}]

    async def step(self, action):  # noqa: ANN001, ANN201
        raise AssertionError("an agent-driven environment takes no steps: its agent makes the calls")

    async def run_agent(self) -> AgentRun:
        started = time.monotonic()
        self.told[self.trajectory_id] = await asyncio.to_thread(self._chat)
        return AgentRun(0, False, time.monotonic() - started, "")

    def _chat(self) -> dict:
        transport = httpx.HTTPTransport(uds=str(self.endpoint.socket_dir / "proxy.sock"))
        told: dict = {"endpoint_model": self.endpoint.model, "answered_as": [], "statuses": []}
        with httpx.Client(transport=transport, base_url="http://proxy/v1", timeout=120,
                          headers={"Authorization": f"Bearer {self.endpoint.key}"}) as client:
            told["models"] = [m["id"] for m in client.get("/models").json()["data"]]
            messages = [{"role": "system", "content": "Guess the number."}, {"role": "user", "content": "Your first guess?"}]
            for follow_up in ("higher", None):
                answer = client.post("/chat/completions", json={"model": self.endpoint.model, "messages": messages})
                told["statuses"].append(answer.status_code)
                if answer.status_code != 200:
                    told["error"] = answer.json()["error"]["message"]
                    break
                told["answered_as"].append(answer.json()["model"])
                if follow_up:
                    reply = answer.json()["choices"][0]["message"]["content"]
                    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": follow_up}]
        return told

    async def verify(self) -> VerifyResult:
        return VerifyResult(1.0)

    async def close(self) -> None:
        pass


PLUGINS = {ChattingAgentEnv.name: f"{__name__}:{ChattingAgentEnv.__name__}"}


class Worker:
    """A rollout worker's context on the real ledger: its own server dead, named ``WORKER_SERVED``;
    ``loads`` the tokenizer paths its ``RunServers`` loaded, ``outage_changes`` its outage switch."""

    def __init__(self, redis_client, tmp_path: Path, run_id: str, own_model_dir: Path):
        self.run_id, self.redis = run_id, redis_client
        self.ledger, self.store = Ledger(redis_client), LocalStore(tmp_path / "objects")
        self.own_url = f"http://127.0.0.1:{free_port()}"
        self.settings = load_settings(
            run_id=run_id, environments=PLUGINS,
            inference={"base_url": self.own_url, "model": WORKER_SERVED, "model_path": str(own_model_dir), "max_model_len": 1024},
            rollout={"max_tokens_per_turn": 12, "agent_socket_dir": str(tmp_path / "sockets")},
            outage={"limit_s": 2.0, "backoff_max_s": 0.2, "log_every_s": 1},
        )
        self.chat = load_chat_tokens(own_model_dir)  # the worker's own tokenizer, a ChatTokens of its own
        self.loads: list[str] = []
        self.outage_changes: list[bool] = []

    def request(self, target: InferenceTarget, group_id: int = 0) -> RolloutRequest:
        seed = ids.episode_seed(0, group_id, 0)
        task = TaskProfile(task_id=f"t{group_id}", env_name=ChattingAgentEnv.name, task_data={})
        request = RolloutRequest(run_id=self.run_id, group_id=group_id, episode_index=0, episode_seed=seed,
                                 trajectory_id=ids.trajectory_id(self.run_id, group_id, 0, seed), group_size=1, task=task,
                                 dispatched_at=time.time(), inference=target)
        self.ledger.register([request])
        return request

    def run(self, requests: list[RolloutRequest]) -> dict:
        async def go():
            servers = RunServers.from_settings(self.settings)
            load = servers.load_chat
            servers.load_chat = lambda path: (self.loads.append(path), load(path))[1]
            own = InferenceClient(self.own_url, WORKER_SERVED, timeout_s=5, outage=self.settings.outage,
                                  on_outage_change=self.outage_changes.append)
            ctx = RolloutContext(settings=self.settings, ledger=self.ledger, store=self.store,
                                 leases=LeaseKeeper(self.ledger, 30, 1), chat=self.chat, scoring=ScoringOutbox(lambda batch: None),
                                 redispatch=lambda request: None, worker_name="test", inference=own, redis=self.redis,
                                 run_servers=servers)
            try:
                return await run_requests(ctx, requests)
            finally:
                if ctx.agent_proxy is not None:
                    await ctx.agent_proxy.stop()
                for served in servers._served.values():
                    await served.client.aclose()
                await own.aclose()

        return asyncio.run(go())


@pytest.fixture
def worker(redis_client, tmp_path, run_id, served_model):
    return Worker(redis_client, tmp_path, run_id, served_model.model_dir)


def _target(base_url: str, model_dir: Path) -> InferenceTarget:
    return InferenceTarget(base_url=base_url, model=RUN_SERVED, model_path=str(model_dir), max_model_len=1024)


def test_an_agent_driven_episode_of_a_run_naming_its_server_is_served_by_that_server(worker, served_model):
    PolicyVersion(worker.redis, worker.run_id).advance(5)
    request = worker.request(_target(served_model.base_url, served_model.model_dir))
    tid = request.trajectory_id
    [result] = worker.run([request]).values()
    assert str(result) == "uploaded", worker.ledger.failure_reasons(worker.run_id).get(tid)
    told = ChattingAgentEnv.told[tid]
    assert told["statuses"] == [200, 200] and told["endpoint_model"] == RUN_SERVED, told
    assert told["models"] == [RUN_SERVED] and told["answered_as"] == [RUN_SERVED] * 2
    trajectory = find_trajectory(worker.store, tid, worker.redis).trajectory
    turns = trajectory.turns
    assert len(turns) == 2 and not turns[1].segment_start and trajectory.env_info["agent"]["calls"] == 2
    assert_recorded_as_vllm_sampled(served_model.base_url, tid, turns, served=RUN_SERVED)
    assert [t.policy_version for t in turns] == [5, 5]
    assert worker.loads == [str(served_model.model_dir)]  # the run's tokenizer, once
    assert worker.outage_changes == []  # the worker's own (dead) server was never called


def test_a_runs_server_that_is_down_fails_its_agent_driven_episode_and_never_the_worker(worker, served_model):
    down = f"http://127.0.0.1:{free_port()}"
    request = worker.request(_target(down, served_model.model_dir))
    started = time.monotonic()
    [result] = worker.run([request]).values()
    waited = time.monotonic() - started
    assert str(result) == "failed:inference_outage"
    failure = worker.ledger.failure_reasons(worker.run_id)[request.trajectory_id]
    assert kind_of(failure) == "inference_outage" and failure.startswith(f"inference_outage: inference at {down} has been unreachable")
    told = ChattingAgentEnv.told[request.trajectory_id]
    assert told["statuses"] == [503] and "unreachable" in told["error"], told  # the agent got one 503 and stopped
    assert 2.0 <= waited < 30, waited
    assert worker.ledger.attempts(request.trajectory_id) == 1
    assert worker.outage_changes == []  # only the worker's own server switches its taking of tasks off
