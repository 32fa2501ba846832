"""Train/eval splits (issue 13, item 2): stable across runs and row order, stratified by
environment, whole environments held out, per-environment eval caps; intake publishes the
rows of its role only (real Redis)."""

from __future__ import annotations

import random


from services.intake.publisher import run_intake
from services.intake.splits import assign_splits
from shared.schemas import TaskProfile
from shared.settings import SplitSettings, load_settings


def tasks(env_name: str, n: int) -> list[TaskProfile]:
    return [TaskProfile(task_id=f"{env_name}-{i}", env_name=env_name, task_data={}) for i in range(n)]


def split_map(items: list[TaskProfile], settings: SplitSettings) -> dict[str, str]:
    return {t.task_id: s for t, s in zip(items, assign_splits(items, settings))}


def test_a_task_keeps_its_split_whatever_the_row_order():
    items = tasks("qa", 200) + tasks("gym", 50)
    settings = SplitSettings(eval_fraction=0.1)
    first = split_map(items, settings)
    shuffled = items[:]
    random.Random(7).shuffle(shuffled)
    assert split_map(shuffled, settings) == first
    assert split_map(items, SplitSettings(eval_fraction=0.1, salt="other")) != first  # the salt draws another split


def test_each_environment_gives_its_share():
    splits = split_map(tasks("qa", 200) + tasks("gym", 10) + tasks("tiny", 3), SplitSettings(eval_fraction=0.1))
    count = lambda env, split: sum(1 for t, s in splits.items() if t.startswith(env + "-") and s == split)  # noqa: E731
    assert (count("qa", "eval"), count("gym", "eval"), count("tiny", "eval")) == (20, 1, 1)  # at least one each
    assert count("qa", "train") == 180


def test_held_out_environments_are_eval_only_and_caps_bound_eval():
    settings = SplitSettings(eval_fraction=0.5, holdout_envs=["gym"], eval_cap_per_env=4)
    splits = split_map(tasks("qa", 20) + tasks("gym", 10), settings)
    qa = [s for t, s in splits.items() if t.startswith("qa-")]
    gym = [s for t, s in splits.items() if t.startswith("gym-")]
    assert qa.count("eval") == 4 and qa.count("train") == 16  # capped; the rest trains
    assert gym.count("eval") == 4 and gym.count("none") == 6 and "train" not in gym  # never trained on


def test_intake_publishes_the_rows_of_its_role_and_the_roles_partition_the_dataset(two_env_rows, redis_client, run_id):
    published: dict[str, set[str]] = {}
    for role in ("train", "eval"):
        settings = load_settings(run_id=f"{run_id}-{role}", rollout={"group_size": 1},
                                 intake={"splits": {"role": role, "eval_fraction": 0.2}})
        sent: list[str] = []
        run_intake(settings, two_env_rows, redis_client, lambda reqs, sent=sent: sent.extend(r.task.task_id for r in reqs))
        published[role] = set(sent)
    assert not published["train"] & published["eval"]
    assert len(published["train"] | published["eval"]) == 40
    assert sum(t.startswith("q") for t in published["eval"]) == 2 and sum(t.startswith("g") for t in published["eval"]) == 6
