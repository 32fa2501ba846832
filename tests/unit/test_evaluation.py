"""Evaluation during training (issue 13, item 3), below the pipeline: pass@k, the per-environment
summary, the settings that keep eval tasks out of training, and one pass on a real Redis where
a thread plays the workers and the scorer through the ledger (the whole pipeline is in
tests/test_evaluation_pipeline.py)."""

from __future__ import annotations

import math
import threading
import time
from itertools import combinations

import pytest

from services.trainer.evaluation import Evaluator, TaskResult, eval_run_id, pass_at_k, summarize
from shared.state.ledger import Ledger
from shared.names import RedisKeys
from shared.state.policy_version import PolicyVersion
from shared.schemas import EvalEnd, RolloutRequest, ScoredEvent, parse_message
from shared.settings import SettingsError, load_settings


def brute_pass_at_k(outcomes: list[bool], k: int) -> float:
    draws = list(combinations(outcomes, k))
    return sum(any(d) for d in draws) / len(draws)


@pytest.mark.parametrize("n,c,k", [(4, 0, 1), (4, 1, 1), (4, 1, 2), (4, 3, 2), (5, 2, 3), (8, 8, 8), (8, 1, 8)])
def test_pass_at_k_is_the_chance_that_one_of_k_draws_passes(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k([True] * c + [False] * (n - c), k))


def test_pass_at_k_refuses_more_draws_than_samples():
    with pytest.raises(ValueError, match="pass@5 needs at least 5 samples"):
        pass_at_k(4, 1, 5)


def test_summary_is_per_environment_and_counts_failures_as_misses():
    tasks = [TaskResult("qa", [1.0, 0.0], failed=0), TaskResult("qa", [0.0], failed=1), TaskResult("gym/v1", [1.0, 1.0], 0)]
    metrics = summarize(tasks, samples_per_task=2, ks=[1, 2], threshold=1.0)
    assert metrics["eval_tasks"] == 3 and metrics["eval_failed"] == 1
    assert metrics["eval_pass_at_1"] == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert metrics["eval_pass_at_2"] == pytest.approx((1.0 + 0.0 + 1.0) / 3)
    assert metrics["eval_qa_pass_at_1"] == pytest.approx(0.25) and metrics["eval_qa_failed"] == 1
    assert metrics["eval_qa_reward_mean"] == pytest.approx(1 / 3)  # a failure has no reward
    assert metrics["eval_gym_v1_pass_at_2"] == 1.0 and metrics["eval_gym_v1_tasks"] == 1


def test_settings_refuse_an_eval_split_that_would_be_trained_on_or_is_empty():
    with pytest.raises(SettingsError, match="intake.splits.role is 'all'"):
        load_settings(evaluation={"every_steps": 2}, intake={"splits": {"eval_fraction": 0.1}})
    with pytest.raises(SettingsError, match="the eval split is empty"):
        load_settings(evaluation={"every_steps": 2}, intake={"splits": {"role": "train"}})
    with pytest.raises(SettingsError, match="pass@8 needs samples_per_task >= 8"):
        load_settings(evaluation={"samples_per_task": 4, "pass_k": [1, 8]})
    ok = load_settings(evaluation={"every_steps": 2}, intake={"splits": {"role": "train", "holdout_envs": ["qa"]}})
    assert ok.evaluation.enabled
    assert load_settings(evaluation={"dataset": "eval.jsonl"}).evaluation.enabled  # at_end with a dataset of its own
    assert not load_settings().evaluation.enabled


def play_workers(ledger: Ledger, requests: list[RolloutRequest], reward_of, fail_every: int = 0) -> None:
    """What the rollout workers and the scorer do to the ledger: claim, upload, score (or fail)."""
    for n, request in enumerate(requests):
        tid = request.trajectory_id
        ok, _ = ledger.claim(tid, "tok", 30)
        assert ok
        if fail_every and n % fail_every == fail_every - 1:
            ledger.fail(tid, "env_error: planted", token="tok")
            continue
        ledger.mark_uploaded(tid, "tok")
        event = ScoredEvent(trajectory_id=tid, run_id=request.run_id, group_id=request.group_id,
                            reward=reward_of(request), scored_key=f"scored/{tid}", at=time.time())
        assert ledger.mark_scored(tid, event).ok


def test_a_pass_publishes_the_eval_split_waits_for_every_trajectory_and_ends_once(two_env_rows, redis_client, store, run_id):
    settings = load_settings(
        run_id=run_id, trainer={"mode": "train", "max_off_policy_steps": 0, "max_steps": 4, "pass_threshold": 1.0},
        intake={"splits": {"role": "train", "eval_fraction": 0.2}},
        evaluation={"every_steps": 2, "samples_per_task": 3, "pass_k": [1, 3], "sync_timeout_s": 5, "timeout_s": 60},  # a broken worker thread fails the test, not hangs it
    )
    ledger = Ledger(redis_client)
    published: list[RolloutRequest] = []
    evaluator = Evaluator(settings, redis_client, store, published.extend, two_env_rows, dataset_version="v@1", poll_s=0.05)
    assert [v for v in range(6) if evaluator.due(v)] == [2, 4]
    PolicyVersion(redis_client, run_id).advance(2)

    # qa tasks: one sample in three passes; guess_number tasks: every third trajectory fails
    def reward_of(request: RolloutRequest) -> float:
        return 1.0 if request.task.env_name == "qa" and request.episode_index == 0 else 0.25

    def workers() -> None:
        # intake publishes group by group: wait for the whole split (8 tasks x 3 samples, asserted
        # below), or a thread that woke after the first group would play only part of it
        deadline = time.monotonic() + 60
        while len(published) < 24 and time.monotonic() < deadline:
            time.sleep(0.01)
        play_workers(ledger, [r for r in published if r.task.env_name != "qa"], reward_of, fail_every=3)
        play_workers(ledger, [r for r in published if r.task.env_name == "qa"], reward_of)

    thread = threading.Thread(target=workers)
    thread.start()
    end = evaluator.evaluate(2)
    thread.join()

    run = eval_run_id(run_id, 2)
    assert end.eval_run_id == run and not end.timed_out and end.served_version == 2
    assert end.tasks == 8 and end.trajectories == 24 and end.scored + end.failed == 24 and end.failed == 6
    assert {r.run_id for r in published} == {run} and len({r.group_id for r in published}) == 8
    assert end.metrics["eval_qa_tasks"] == 2 and end.metrics["eval_guess_number_tasks"] == 6
    assert end.metrics["eval_qa_pass_at_1"] == pytest.approx(1 / 3) and end.metrics["eval_qa_pass_at_3"] == 1.0
    assert end.metrics["eval_guess_number_pass_at_3"] == 0.0 and end.metrics["eval_guess_number_failed"] == 6
    # the end signal: one entry on the run's eval stream; the eval run's ledger ends exact
    entries = redis_client.xrange(RedisKeys.eval_stream(run_id))
    assert [parse_message(EvalEnd, f["eval"]) for _, f in entries] == [end]
    counts = ledger.counts(run)
    assert counts["consumed"] == 18 and counts["failed"] == 6 and sum(counts.values()) == 24
    # evaluating the version again publishes nothing and signals nothing
    published.clear()
    assert evaluator.evaluate(2) == end and not published and len(redis_client.xrange(RedisKeys.eval_stream(run_id))) == 1


def test_a_pass_nobody_works_on_ends_timed_out_and_says_what_was_served(two_env_rows, redis_client, store, run_id):
    settings = load_settings(
        run_id=run_id, intake={"splits": {"role": "train", "eval_fraction": 0.1}},
        evaluation={"every_steps": 1, "samples_per_task": 2, "sync_timeout_s": 0.2, "timeout_s": 0.5},
    )
    evaluator = Evaluator(settings, redis_client, store, lambda requests: None, two_env_rows, poll_s=0.05)
    end = evaluator.evaluate(1)
    assert end.timed_out and end.served_version == 0 and end.scored == 0 and end.trajectories == 8
    assert end.metrics["eval_timed_out"] == 1.0 and end.metrics["eval_pass_at_1"] == 0.0
    assert not math.isnan(end.metrics["eval_seconds"])
