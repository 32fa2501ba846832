"""``conveyor status --failures RUN`` and ``conveyor retry RUN``, run as the real command against
a real Redis, on a run that real intake published and the real trainer consumer decided:

- the failure report counts every failed trajectory under its reason's kind, with examples,
  and lists the rejected intake rows;
- retry re-opens only a group the trainer decided with every member failed: the chosen members
  go back to the queue with a fresh attempt budget and are published on the broker once; a
  group with consumed members and a group still in progress are left alone, and said so;
- the trainer then decides the re-opened group again, and nothing consumed is consumed twice.
"""

from __future__ import annotations

import base64
import json
import time

import pytest
from test_cli_errors import conveyor

from services.cli.demo import write_demo_dataset
from services.intake.datasets import read_rows
from services.intake.publisher import run_intake
from services.trainer.consumer import TrainerConsumer
from shared.state.ledger import Ledger
from shared.state.ledger_retry import NOT_DECIDED, TRAINED
from shared.names import ROLLOUT_QUEUE, RedisKeys
from shared.schemas import ScoredEvent
from shared.settings import load_settings
from shared.storage import LocalStore
from shared.state.trainer_counters import TrainerCounters

RUN = "retryrun"
OUTAGE_REASON = "inference_outage: inference at http://vllm:8000 has been unreachable for 901s, longer than outage.limit_s (900s)"


def _scored(ledger: Ledger, tid: str, group_id: int, reward: float) -> None:
    assert ledger.claim(tid, "tok", 30)[0]
    assert ledger.mark_uploaded(tid, "tok").ok
    event = ScoredEvent(trajectory_id=tid, run_id=RUN, group_id=group_id, reward=reward, scored_key=f"scored/{tid}", at=time.time())
    assert ledger.mark_scored(tid, event).ok


def _failed(ledger: Ledger, tid: str, reason: str) -> None:
    assert ledger.claim(tid, "tok", 30)[0]
    assert ledger.fail(tid, reason, token="tok").ok


def _decide(consumer: TrainerConsumer) -> None:
    while consumer.poll(block_ms=50):
        pass


def _broker_messages(redis_client) -> list[list[dict]]:
    """The rollout tasks waiting on the broker: each one's list of requests."""
    bodies = [json.loads(raw) for raw in redis_client.lrange(ROLLOUT_QUEUE, 0, -1)]
    return [json.loads(base64.b64decode(body["body"]))[0][0] for body in bodies]


@pytest.fixture
def decided_run(redis_client, redis_url, tmp_path):
    """Group 0: every member failed (3 inference outages, 1 environment error), decided
    all_failed. Group 1: two consumed, two infra errors. Group 3: one infra error, the rest
    running (group 2 is a rejected row)."""
    dataset = write_demo_dataset(tmp_path / "guess.jsonl", 3)
    lines = dataset.read_text().splitlines()
    dataset.write_text("\n".join([*lines[:2], '{"task_data": {"low": 1, "high": 5, "target": 99}}', lines[2]]) + "\n")
    settings = load_settings(run_id=RUN, redis={"url": redis_url}, trainer={"metrics_path": str(tmp_path / "metrics.jsonl")})
    ledger = Ledger(redis_client)
    store = LocalStore(tmp_path / "objects")
    report = run_intake(settings, read_rows(dataset), redis_client, lambda requests: None, store=store)
    assert (report.groups, len(report.rejected)) == (3, 1)
    g = {gid: sorted(t for t in ledger.states(RUN) if t.startswith(f"{RUN}_{gid}_")) for gid in (0, 1, 3)}
    for tid in g[0][:3]:
        _failed(ledger, tid, OUTAGE_REASON)
    _failed(ledger, g[0][3], "env_error: reset: ValueError: no target")
    for tid in g[1][:2]:
        _scored(ledger, tid, 1, reward=0.5)  # equal rewards: zero variance, consumed without a batch
    for tid in g[1][2:]:
        _failed(ledger, tid, "infra_error: SandboxInfraError: daemon down (after 3 attempts)")
    _failed(ledger, g[3][0], "infra_error: StorageError: refused (after 3 attempts)")
    for tid in g[3][1:]:
        assert ledger.claim(tid, "tok", 30)[0]
    consumer = TrainerConsumer(settings, redis_client, store)
    _decide(consumer)
    assert ledger.redis.smembers(RedisKeys.groups_done(RUN)) == {"0", "1"}
    return ledger, consumer, g


def test_status_failures_counts_reasons_with_examples_and_lists_rejected_rows(decided_run, redis_url, tmp_path):
    result = conveyor("status", "--failures", RUN, "--json", cwd=tmp_path, CONVEYOR_REDIS__URL=redis_url)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["trajectories"], report["failed"]) == (12, 7)
    assert [(r["kind"], r["count"]) for r in report["reasons"]] == [("inference_outage", 3), ("infra_error", 3), ("env_error", 1)]
    outage = report["reasons"][0]["examples"]
    assert len(outage) == 3 and all(e["reason"] == OUTAGE_REASON and e["trajectory_id"].startswith(f"{RUN}_0_") for e in outage)
    assert [r["source"].rsplit(":", 1)[1] for r in report["rejected_rows"]] == ["3"] and "outside [1, 5]" in report["rejected_rows"][0]["reason"]

    table = conveyor("status", "--failures", RUN, cwd=tmp_path, CONVEYOR_REDIS__URL=redis_url)
    assert table.returncode == 0, table.stderr
    assert f"run {RUN}: 7 of 12 trajectories failed" in table.stdout and "inference_outage" in table.stdout
    assert "rejected intake rows: 1" in table.stdout

    unknown = conveyor("status", "--failures", "nosuchrun", cwd=tmp_path, CONVEYOR_REDIS__URL=redis_url)
    assert unknown.returncode == 2 and unknown.stderr.startswith("error: Redis holds no run 'nosuchrun'")


def test_retry_reopens_only_an_all_failed_group_and_the_trainer_decides_it_again(decided_run, redis_url, tmp_path):
    ledger, consumer, g = decided_run
    redis = ledger.redis
    counters = TrainerCounters(redis, RUN)
    consumed_before = {t for t, s in ledger.states(RUN).items() if s == "consumed"}
    stream_before = redis.xlen(RedisKeys.trainer_stream(RUN))

    result = conveyor("retry", RUN, "--reason", "inference_outage", "--json", cwd=tmp_path, CONVEYOR_REDIS__URL=redis_url)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"run": RUN, "retried": 3, "groups": [0], "left": []}
    for tid in g[0][:3]:  # back in the queue with a fresh attempt budget, no failure reason
        assert ledger.state(tid) == "queued" and ledger.attempts(tid) == 0 and tid not in ledger.failure_reasons(RUN)
    assert ledger.state(g[0][3]) == "failed"  # the environment error was not asked for
    assert [[r["trajectory_id"] for r in msg] for msg in _broker_messages(redis)] == [g[0][:3]]  # published once
    assert redis.xlen(RedisKeys.trainer_stream(RUN)) == stream_before + 1  # the kept member's failure, again
    assert not redis.sismember(RedisKeys.groups_done(RUN), 0)
    assert counters.get("groups_reopened") == 1

    again = conveyor("retry", RUN, "--reason", "infra_error", "--json", cwd=tmp_path, CONVEYOR_REDIS__URL=redis_url)
    assert again.returncode == 0, again.stderr
    summary = json.loads(again.stdout)
    assert summary["retried"] == 0 and summary["groups"] == []
    assert {entry["why"]: entry["examples"] for entry in summary["left"]} == {TRAINED: g[1][2:], NOT_DECIDED: [g[3][0]]}
    assert len(_broker_messages(redis)) == 1
    assert {t: ledger.state(t) for t in g[1][2:] + g[3][:1]} == dict.fromkeys(g[1][2:] + g[3][:1], "failed")

    for tid in g[0][:3]:  # the retried members roll out and are scored
        _scored(ledger, tid, 0, reward=0.25)
    _decide(consumer)
    states = ledger.states(RUN)
    assert {states[t] for t in g[0][:3]} == {"consumed"} and states[g[0][3]] == "failed"
    assert redis.sismember(RedisKeys.groups_done(RUN), 0)
    assert {t for t, s in states.items() if s == "consumed"} == consumed_before | set(g[0][:3])
    assert counters.get("duplicate_events") == 0 and counters.get("late_events") == 0
    assert counters.get("groups_all_failed") == 1 and counters.get("groups_zero_variance") == 2  # decided twice, counted twice
