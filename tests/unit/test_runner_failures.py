"""The rollout runner's failure handling, on a real Redis ledger: a known infra error is retried
with backoff up to ``ledger.max_attempts``; a bug fails at once with its traceback and never
spends a retry; the environment's own error and an inference outage past the limit fail at
once with a reason that names them; a shutdown hands running trajectories back without
spending an attempt.

The environments here are test doubles registered for these tests only; the ledger, the leases,
the store, the tokenizer and the HTTP client are the real ones.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import pytest

from services.cli.local_stack import free_port
from services.inference.tiny_model import generate_tiny_model
from services.rollout_worker.chat_tokens import load_chat_tokens
from shared.environments import Environment, StepResult, VerifyResult
from services.rollout_worker.inference_client import InferenceClient
from services.rollout_worker.runner import RolloutContext, retry_delay_s, run_requests
from services.rollout_worker.sandbox.errors import SandboxInfraError
from services.rollout_worker.scoring_outbox import ScoringOutbox
from shared import ids
from shared.state.leases import LeaseKeeper
from shared.names import RedisKeys
from shared.outcomes import FailureKind, RolloutOutcome, kind_of
from shared.schemas import RolloutRequest, TaskProfile
from shared.settings import RolloutSettings, load_settings

MAX_ATTEMPTS = 3


class _Env(Environment):
    async def step(self, action):  # noqa: ANN001, ANN201
        return StepResult("ok", done=True)

    async def verify(self) -> VerifyResult:
        return VerifyResult(0.0)


class DaemonDown(_Env):
    name = "test_daemon_down"

    async def reset(self, task_data, seed):  # noqa: ANN001, ANN201
        raise SandboxInfraError("docker daemon unreachable", reason="daemon_unreachable")


class Buggy(_Env):
    """Returns no messages at all: the chat template then fails outside the environment's own
    calls, as a bug in Conveyor would."""

    name = "test_buggy"

    async def reset(self, task_data, seed):  # noqa: ANN001, ANN201
        return 42


class Broken(_Env):
    name = "test_broken"

    async def reset(self, task_data, seed):  # noqa: ANN001, ANN201
        raise ValueError("task data has no 'target'")


class Talks(_Env):
    name = "test_talks"

    async def reset(self, task_data, seed):  # noqa: ANN001, ANN201
        return [{"role": "user", "content": "say something"}]


class Hangs(_Env):
    name = "test_hangs"
    closed = 0

    async def reset(self, task_data, seed):  # noqa: ANN001, ANN201
        await asyncio.Event().wait()

    async def close(self) -> None:
        Hangs.closed += 1


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return load_chat_tokens(generate_tiny_model(tmp_path_factory.mktemp("runner") / "tiny", end_of_turn_bias=4.0))


# the test environments are plugins, named in settings as users name theirs
PLUGINS = {env.name: f"{__name__}:{env.__name__}" for env in (DaemonDown, Buggy, Broken, Talks, Hangs)}


class Harness:
    def __init__(self, ledger, store, chat, run_id, outage_limit_s=900.0):
        self.settings = load_settings(
            run_id=run_id, environments=PLUGINS,
            ledger={"max_attempts": MAX_ATTEMPTS, "lease_ttl_s": 30, "heartbeat_s": 1},
            rollout={"retry_backoff_s": 0.2, "retry_backoff_max_s": 0.3},
            outage={"limit_s": outage_limit_s, "backoff_max_s": 0.2, "log_every_s": 1},
        )
        self.ledger, self.run_id = ledger, run_id
        self.redispatched: list[RolloutRequest] = []
        self.scoring: list[str] = []
        self.outage_changes: list[bool] = []
        self.port = free_port()  # nothing listens there
        self.store, self.chat = store, chat

    async def context(self) -> RolloutContext:
        client = InferenceClient(f"http://127.0.0.1:{self.port}", "tiny", timeout_s=5, outage=self.settings.outage,
                                 on_outage_change=self.outage_changes.append)
        return RolloutContext(
            settings=self.settings, ledger=self.ledger, store=self.store,
            leases=LeaseKeeper(self.ledger, 30, 1), chat=self.chat,
            scoring=ScoringOutbox(lambda batch: self.scoring.extend(task.trajectory_id for task in batch)),
            redispatch=self.redispatched.append, worker_name="test", inference=client, redis=self.ledger.redis,
        )

    def request(self, env_name: str, group_id: int = 0) -> RolloutRequest:
        seed = ids.episode_seed(0, group_id, 0)
        task = TaskProfile(task_id=f"t{group_id}", env_name=env_name, task_data={})
        request = RolloutRequest(
            run_id=self.run_id, group_id=group_id, episode_index=0, episode_seed=seed,
            trajectory_id=ids.trajectory_id(self.run_id, group_id, 0, seed), group_size=1, task=task, dispatched_at=time.time(),
        )
        self.ledger.register([request])
        return request

    def run(self, requests: list[RolloutRequest], ctx: RolloutContext | None = None) -> dict:
        async def go():
            context = ctx or await self.context()
            try:
                return await run_requests(context, requests)
            finally:
                if ctx is None:  # its own context: its client's session closes in the loop that opened it
                    await context.inference.aclose()

        return asyncio.run(go())


@pytest.fixture
def harness(ledger, store, chat, run_id):
    return Harness(ledger, store, chat, run_id)


def test_a_known_infra_error_is_retried_with_backoff_then_fails_as_infra_error(harness, ledger):
    request = harness.request(DaemonDown.name)
    tid = request.trajectory_id
    waits = []
    for attempt in range(1, MAX_ATTEMPTS + 1):
        started = time.monotonic()
        [result] = harness.run([request]).values()
        waits.append(time.monotonic() - started)
        if attempt < MAX_ATTEMPTS:  # queued again and published again, after a backoff
            assert result.outcome is RolloutOutcome.requeued
            assert ledger.state(tid) == "queued" and harness.redispatched[-1] == request
            assert waits[-1] >= retry_delay_s(attempt, harness.settings.rollout)
    assert result.outcome is RolloutOutcome.failed and result.detail == FailureKind.infra_error.value
    assert ledger.state(tid) == "failed" and ledger.attempts(tid) == MAX_ATTEMPTS
    failure = ledger.failure_reasons(harness.run_id)[tid]
    assert kind_of(failure) == "infra_error"
    assert "SandboxInfraError: docker daemon unreachable" in failure and f"after {MAX_ATTEMPTS} attempts" in failure
    assert len(harness.redispatched) == MAX_ATTEMPTS - 1


def test_a_bug_fails_at_once_with_its_traceback_and_spends_no_retry(harness, ledger):
    request = harness.request(Buggy.name)
    [result] = harness.run([request]).values()
    tid = request.trajectory_id
    assert result.outcome is RolloutOutcome.failed and result.detail == FailureKind.bug.value
    assert ledger.state(tid) == "failed" and ledger.attempts(tid) == 1
    assert harness.redispatched == []  # never queued again
    failure = ledger.failure_reasons(harness.run_id)[tid]
    assert kind_of(failure) == "bug"
    assert "Traceback (most recent call last)" in failure and "chat_tokens.py" in failure  # where it broke


def test_an_environment_error_fails_at_once_with_its_reason(harness, ledger):
    request = harness.request(Broken.name)
    [result] = harness.run([request]).values()
    assert str(result) == "failed:env_error"
    failure = ledger.failure_reasons(harness.run_id)[request.trajectory_id]
    assert failure == "env_error: reset: ValueError: task data has no 'target'"
    assert ledger.attempts(request.trajectory_id) == 1 and harness.redispatched == []


def test_inference_unreachable_longer_than_the_limit_fails_naming_the_outage(ledger, store, chat, run_id):
    harness = Harness(ledger, store, chat, run_id, outage_limit_s=1.5)
    requests = [harness.request(Talks.name, group_id=g) for g in range(3)]
    started = time.monotonic()
    results = harness.run(requests)
    waited = time.monotonic() - started
    assert {str(r) for r in results.values()} == {"failed:inference_outage"}
    assert 1.5 <= waited < 10  # waited out the limit, once for all three (one outage per process)
    for request in requests:
        failure = ledger.failure_reasons(run_id)[request.trajectory_id]
        assert failure.startswith(f"inference_outage: inference at http://127.0.0.1:{harness.port} has been unreachable for ")
        assert "longer than outage.limit_s (1.5s)" in failure and "Cannot connect to host" in failure
        assert ledger.attempts(request.trajectory_id) == 1
    assert harness.outage_changes == [False]  # the worker stopped taking tasks once; inference never came back


def test_a_shutdown_hands_running_episodes_back_without_spending_an_attempt(harness, ledger):
    request = harness.request(Hangs.name)
    tid = request.trajectory_id
    Hangs.closed = 0

    async def go():
        ctx = await harness.context()
        task = asyncio.ensure_future(run_requests(ctx, [request]))
        while ledger.state(tid) != "running":
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert len(ctx.in_flight) == 1
        assert ctx.in_flight.stop() == 1  # the grace period ran out
        results = await task
        late = await run_requests(ctx, [request])  # claimed after the stop: handed back at once
        return results, late

    results, late = asyncio.run(go())
    assert str(results[tid]) == "handed_back" and str(late[tid]) == "handed_back"
    assert ledger.state(tid) == "queued" and ledger.attempts(tid) == 0
    assert ledger.lease_owner(tid) is None
    assert harness.redispatched == [request, request]
    assert Hangs.closed == 1  # the cancelled episode closed its environment


def test_retry_backoff_doubles_up_to_its_cap():
    rollout = RolloutSettings(retry_backoff_s=2, retry_backoff_max_s=30)
    assert [retry_delay_s(a, rollout) for a in (1, 2, 3, 4, 5, 6)] == [2, 4, 8, 16, 30, 30]


def test_only_the_lease_owner_hands_a_trajectory_back(harness, ledger):
    tid = harness.request(Talks.name).trajectory_id
    assert ledger.claim(tid, "owner", 30) == (True, "1")
    assert ledger.hand_back(tid, "intruder").state == "not_owner"
    assert ledger.hand_back(tid, "owner").ok
    assert ledger.hand_back(tid, "owner").state == "queued"  # once
    assert (ledger.state(tid), ledger.attempts(tid), ledger.counts(harness.run_id)["queued"]) == ("queued", 0, 1)
    assert ledger.claim(tid, "next", 30) == (True, "1")  # the next claim is attempt 1 again


def _failed_while_running(harness: Harness, ledger, request: RolloutRequest, fail: Callable[[], bool]) -> dict:
    """Run ``request``'s hanging episode; once it runs, ``fail()`` fails it in the ledger, then one
    heartbeat finds the lease gone and cancels the episode. Returns ``run_requests``' results."""
    Hangs.closed = 0

    async def go():
        ctx = await harness.context()
        loop = asyncio.get_running_loop()
        ctx.leases.on_lost = lambda ids: loop.call_soon_threadsafe(ctx.in_flight.cancel, ids)  # as tasks.py wires it
        task = asyncio.ensure_future(run_requests(ctx, [request]))
        while ledger.state(request.trajectory_id) != "running":
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert fail()
        assert await asyncio.to_thread(ctx.leases.beat) == 0  # what the heartbeat thread does every heartbeat_s
        return await asyncio.wait_for(task, 10)

    return asyncio.run(go())


def test_a_superseded_episode_is_cancelled_at_the_next_heartbeat_and_writes_nothing(harness, ledger):
    """Group redundancy: the trainer fails a late member as superseded while its episode runs;
    the worker's lease heartbeat finds the lease gone and cancels the episode, which closes its
    environment and leaves the ledger as the trainer wrote it."""
    request = harness.request(Hangs.name)
    tid = request.trajectory_id
    results = _failed_while_running(harness, ledger, request,
                                    lambda: ledger.fail(tid, "superseded: group 0 kept its first 4 scored members").ok)
    assert str(results[tid]) == "skipped:lease_lost" and Hangs.closed == 1
    assert ledger.state(tid) == "failed"
    assert ledger.redis.hget(RedisKeys.failures(harness.run_id), tid).startswith("superseded")
    assert harness.scoring == [] and harness.redispatched == []


def test_a_task_of_a_stopped_run_is_failed_not_run_and_another_runs_task_still_runs(harness, ledger, store, chat):
    from shared.state.run_stop import request_stop

    stopped = harness.request(Broken.name)
    other = Harness(ledger, store, chat, harness.run_id + "x")
    runs = other.request(Broken.name)
    request_stop(ledger.redis, harness.run_id, "bad data")
    [result] = harness.run([stopped]).values()
    assert str(result) == "failed:run_stopped" and ledger.attempts(stopped.trajectory_id) == 1
    assert ledger.failure_reasons(harness.run_id)[stopped.trajectory_id].startswith("run_stopped: bad data (by ")
    [result] = other.run([runs]).values()
    assert str(result) == "failed:env_error"  # the same worker code runs the other run's episode: it reached reset
    assert harness.scoring == [] and harness.redispatched == []


def test_an_episode_running_when_its_run_is_stopped_is_cut_at_the_next_heartbeat(harness, ledger):
    """``conveyor run stop`` fails the run's running trajectories; the worker's heartbeat finds the
    lease gone and cancels the episode, as for a superseded member."""
    from shared.state.ledger import UNFINISHED
    from shared.state.run_stop import end_unfinished, request_stop

    request = harness.request(Hangs.name)
    tid = request.trajectory_id

    def stop_the_run() -> bool:
        stop, recorded = request_stop(ledger.redis, harness.run_id, "diverged")
        return recorded and end_unfinished(ledger, harness.run_id, stop, UNFINISHED) == 1

    results = _failed_while_running(harness, ledger, request, stop_the_run)
    assert str(results[tid]) == "skipped:lease_lost" and Hangs.closed == 1
    assert ledger.failure_reasons(harness.run_id)[tid].startswith("run_stopped: diverged (by ")
    assert ledger.counts(harness.run_id)["failed"] == 1 and harness.scoring == [] and harness.redispatched == []


def test_an_upload_whose_ledger_reply_was_lost_still_goes_to_scoring_and_another_attempts_does_not(harness, ledger):
    """Redis went away with the reply of running -> uploaded (the move took): the worker finds the
    trajectory uploaded and no later attempt claimed, so the upload is its own and scoring is
    sent. A worker whose lease expired and whose trajectory another attempt uploaded drops its result."""
    from services.rollout_worker.runner import upload_bundle
    from shared.schemas import StopReason, Trajectory

    ctx = asyncio.run(harness.context())
    mine = harness.request(Talks.name, group_id=0)
    _, attempt = ledger.claim(mine.trajectory_id, "tok", 30)
    assert ledger.mark_uploaded(mine.trajectory_id, "tok").ok  # its reply never reached the worker
    [(result, scoring)] = upload_bundle(ctx, [(Trajectory(request=mine, turns=[], stop_reason=StopReason.done, attempt=int(attempt)), "tok")])
    assert str(result) == "uploaded" and scoring.trajectory_id == mine.trajectory_id  # to be sent

    theirs = harness.request(Talks.name, group_id=1)
    tid = theirs.trajectory_id
    _, first = ledger.claim(tid, "slow", 30)
    assert ledger.expire(tid, MAX_ATTEMPTS, now=time.time() + 60) == "requeued"  # the slow worker's lease ran out
    assert ledger.claim(tid, "fast", 30)[0] and ledger.mark_uploaded(tid, "fast").ok
    [(result, scoring)] = upload_bundle(ctx, [(Trajectory(request=theirs, turns=[], stop_reason=StopReason.done, attempt=int(first)), "slow")])
    assert str(result) == "skipped:uploaded" and scoring is None
