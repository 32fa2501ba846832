"""Environment mixing (issue 13, item 5): intake draws each group's environment by weight, and a
training step holds at least its minimum share of each environment (the step's selection,
``services.trainer.selection``; its commit and replay on a real Redis are in
tests/trainer/test_training_loop.py)."""

from __future__ import annotations

from collections import Counter

import pytest

from services.intake.publisher import run_intake
from services.trainer.selection import select
from shared.schemas import SkippedGroupEntry, TrainBatchEntry
from shared.settings import SettingsError, load_settings


def entry(group_id: int, env: str, oldest: int = 0) -> str:
    return TrainBatchEntry(group_id=group_id, key=f"b/{group_id}", oldest_policy_version=oldest, env_name=env).model_dump_json()


def never_stale(oldest: int, version: int) -> bool:
    return False


QUEUE = [entry(0, "a"), entry(1, "a"), entry(2, "a"), entry(3, "a"), entry(4, "b"), entry(5, "a"), entry(6, "b"), entry(7, "a")]


def test_a_step_holds_its_minimum_share_and_defers_the_surplus():
    selection = select(QUEUE, 0, 0, 4, never_stale, min_env_share={"b": 0.5}, mixing_window=8)
    assert selection.complete and selection.keys == ["b/0", "b/1", "b/4", "b/6"] and selection.envs == ["a", "a", "b", "b"]
    assert selection.deferred == [QUEUE[2], QUEUE[3], QUEUE[5]] and selection.cursor == 7 and selection.quota_short == 0


def test_without_shares_a_step_takes_the_queue_in_order():
    selection = select(QUEUE, 0, 0, 4, never_stale)
    assert selection.keys == ["b/0", "b/1", "b/2", "b/3"] and not selection.deferred and selection.cursor == 4


def test_a_quota_the_queue_cannot_meet_waits_then_fills_in_order_past_the_window():
    only_a = [entry(i, "a") for i in range(6)]
    waiting = select(only_a, 0, 0, 4, never_stale, min_env_share={"b": 0.25}, mixing_window=8)
    assert not waiting.complete  # three a's taken, three deferred: waits for a b
    passed = select(only_a, 0, 0, 4, never_stale, min_env_share={"b": 0.25}, mixing_window=1)
    assert passed.complete and passed.keys == ["b/0", "b/1", "b/2", "b/4"] and passed.deferred == [only_a[3]]
    assert passed.quota_short == 1


def test_stale_dropped_and_bad_entries_are_passed_over_as_before():
    queue = [entry(0, "a", oldest=0), SkippedGroupEntry(group_id=1, skip="zero_variance", rewards=[1.0, 1.0]).model_dump_json(),
             "{not json", entry(3, "b", oldest=5), entry(4, "a", oldest=5)]
    selection = select(queue, 10, 5, 2, lambda oldest, version: version - oldest > 1, min_env_share={"b": 0.5})
    assert selection.complete and selection.keys == ["b/3", "b/4"] and selection.stale == 1 and selection.dropped == 1
    assert list(selection.bad) == [12] and selection.cursor == 15


def test_settings_refuse_shares_that_do_not_fit_a_step_and_weights_that_draw_nothing():
    with pytest.raises(SettingsError, match="asks for 5 groups of a step of 4"):
        load_settings(trainer={"mode": "train", "max_off_policy_steps": 0, "groups_per_step": 4, "min_env_share": {"a": 0.5, "b": 0.5, "c": 0.1}})
    with pytest.raises(SettingsError, match="every share is between 0 and 1"):
        load_settings(trainer={"max_off_policy_steps": 0, "min_env_share": {"a": 1.5}})
    with pytest.raises(SettingsError, match="one at least is > 0"):
        load_settings(intake={"env_weights": {"a": 0}})
    with pytest.raises(SettingsError, match="set sample_order to 'replacement'"):
        load_settings(intake={"mode": "sample", "sample_order": "shuffled_epochs", "env_weights": {"a": 1}})


def published_envs(two_env_rows, redis_client, run_id: str, weights: dict[str, float], groups: int = 400) -> list[str]:
    settings = load_settings(run_id=run_id, rollout={"group_size": 1},
                             intake={"mode": "sample", "num_groups": groups, "env_weights": weights})
    sent: list[str] = []
    run_intake(settings, two_env_rows, redis_client, lambda reqs: sent.extend(r.task.env_name for r in reqs))
    return sent


def test_intake_draws_environments_by_weight_the_same_way_every_run(two_env_rows, redis_client, run_id):
    # the dataset holds 30 guess_number rows and 10 qa rows: unweighted, qa would be a quarter
    envs = published_envs(two_env_rows, redis_client, f"{run_id}-a", {"qa": 3, "guess_number": 1})
    share = Counter(envs)["qa"] / len(envs)
    assert 0.68 < share < 0.82, share
    assert published_envs(two_env_rows, redis_client, f"{run_id}-b", {"qa": 3, "guess_number": 1}) == envs
    assert set(published_envs(two_env_rows, redis_client, f"{run_id}-c", {"qa": 1}, groups=50)) == {"qa"}
