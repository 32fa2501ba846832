"""A Redis Cluster keeps each run on one slot: every key of a run hashes to the run's slot, the
keys that span runs are the named few, and every Lua script is called with the keys of one slot
(on the real cluster, which refuses any other with CROSSSLOT)."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest
from redis.commands.core import Script
from redis.crc import key_slot
from test_ledger import requests_for, scored_event

from shared.names import CROSS_RUN_KEYS, RedisKeys
from shared.schemas import EvalEnd
from shared.state import redis_scripts
from shared.state.eval_ends import EvalEnds
from shared.state.ledger import SCORING, Ledger
from shared.state.ledger_retry import retry_failed
from shared.state.policy_version import PolicyVersion
from shared.state.replica_holders import ReplicaHolders
from shared.state.staleness import StalenessBudget
from shared.state.train_queue import TrainQueue

ROOT = Path(__file__).resolve().parents[2]
RUNS = ["r1", "t3f9a0c1d", "grpo-math-2026-11-27", "eval-r1-v3"]
PER_RUN = sorted(name for name, value in vars(RedisKeys).items() if isinstance(value, staticmethod))


def slot(key: str) -> int:
    return key_slot(key.encode())


def test_every_key_is_a_runs_or_one_of_the_named_cross_run_keys():
    fixed = {name for name, value in vars(RedisKeys).items() if isinstance(value, str) and not name.startswith("_")}
    assert fixed == set(CROSS_RUN_KEYS)
    assert {"leases", "scoring_leases", "policy_version", "run_marker", "trainer_stream"} <= set(PER_RUN)


@pytest.mark.parametrize("family", PER_RUN)
def test_every_key_of_a_run_hashes_to_the_runs_one_slot(family):
    for run in RUNS:
        key = getattr(RedisKeys, family)(run)
        assert f"{{{run}}}" in key and slot(key) == slot(RedisKeys.run_marker(run)) == key_slot(run.encode())


def test_runs_spread_over_slots():
    assert len({slot(RedisKeys.states(f"run{i}")) for i in range(64)}) > 32


def test_the_script_owners_are_those_exercised_below():
    """A new module that registers a Lua script must be exercised on the cluster here too."""
    owners = set()
    for path in [*ROOT.joinpath("shared").rglob("*.py"), *ROOT.joinpath("services").rglob("*.py")]:
        tree = ast.parse(path.read_text())
        if any(isinstance(node, ast.Attribute) and node.attr == "register_script" for node in ast.walk(tree)):
            owners.add(str(path.relative_to(ROOT)))
    assert owners == {"shared/state/ledger/transitions.py", "shared/state/ledger_retry.py", "shared/state/policy_version.py",
                      "shared/state/staleness.py", "shared/state/replica_holders.py", "shared/state/train_queue.py",
                      "shared/state/eval_ends.py"}


@pytest.fixture
def script_keys(monkeypatch) -> list[list[str]]:
    """The KEYS of every script call made, alone or pipelined."""
    calls: list[list[str]] = []
    original_call, original_pipelined = Script.__call__, redis_scripts.run_pipelined

    def call(self, keys=(), args=(), client=None):
        calls.append(list(keys))
        return original_call(self, keys=keys, args=args, client=client)

    def pipelined(client, script_calls):
        calls.extend(list(c.keys) for c in script_calls if len(script_calls) > 1)
        return original_pipelined(client, script_calls)

    monkeypatch.setattr(Script, "__call__", call)
    monkeypatch.setattr("shared.state.ledger.transitions.run_pipelined", pipelined)
    return calls


@pytest.mark.parametrize("redis_topology_url", ["cluster"], indirect=True)
def test_every_script_keeps_to_one_slot_on_a_real_cluster(redis_client, script_keys, run_id):
    ledger = Ledger(redis_client)
    requests = requests_for(run_id, size=4)
    tids = [r.trajectory_id for r in requests]
    assert ledger.register(requests) == 4  # REGISTER
    assert all(ok for ok, _ in ledger.claim_many([(t, f"k{i}", "") for i, t in enumerate(tids)], 30))  # CLAIM, pipelined
    assert ledger.renew({tids[0]: "k0"}, 30) == []  # HEARTBEAT
    assert ledger.hand_back(tids[3], "k3").ok  # HAND_BACK
    assert ledger.mark_uploaded_many([(tids[0], "k0", "{}"), (tids[1], "k1", "{}")], 5.0)[0].ok  # TRANSITION
    assert ledger.scoring_sent(tids[:2]) == 2  # SENT
    assert ledger.claim(tids[0], "s0", 30, SCORING)[0]
    assert ledger.mark_scored(tids[0], scored_event(tids[0], run_id), token="s0").ok
    assert ledger.mark_consumed(tids[0]).ok
    assert ledger.expire(tids[3], 3, now=time.time() + 1e6) == "resent"  # EXPIRE
    for tid in tids[1:]:
        assert ledger.fail(tid, "infra_error: x").ok
    with redis_client.pipeline(transaction=False) as pipe:  # the trainer decided group 1 (all failed)
        retry_group = requests_for(run_id, group_id=1, size=2)
        ledger.register(retry_group)
        for request in retry_group:
            ledger.fail(request.trajectory_id, "infra_error: y")
        pipe.sadd(RedisKeys.groups_done(run_id), 1)
        pipe.execute()
    assert len(retry_failed(redis_client, run_id, None, lambda published: None).retried) == 2  # RETRY_GROUP
    assert PolicyVersion(redis_client, run_id).advance(2)
    budget = StalenessBudget(redis_client, run_id, max_off_policy_steps=1, groups_per_step=2)
    assert budget.try_admit() and budget.advance_step(1) == 1
    holders = ReplicaHolders(redis_client)
    assert holders.claim(["http://r:1"], run_id, trains=True, model="m") is None and holders.release(["http://r:1"], run_id) == 1
    TrainQueue(redis_client, run_id).commit_selection(1, 0, 0, 0, 0, [])
    end = EvalEnd(run_id=run_id, eval_run_id=f"{run_id}-eval", policy_version=1, served_version=1, tasks=1, trajectories=1,
                  scored=1, failed=0, timed_out=False, metrics={})
    assert EvalEnds(redis_client, run_id).end_once(end)
    assert len(script_keys) >= 20
    for keys in script_keys:
        assert len({slot(key) for key in keys}) == 1, keys
