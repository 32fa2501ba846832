"""Intake refuses a single_turn row whose reward_fn is missing or cannot be imported: it is a
rejected row with the reason, not a group whose every episode fails in the workers."""

from __future__ import annotations

import json
import os

import pytest

from services.intake.adapters import RowRejected, adapt_row
from services.intake.datasets import Row
from services.intake.publisher import run_intake
from shared.names import RedisKeys
from shared.settings import Settings

GOOD = "services.rollout_worker.environments.toy_rewards:digit_share"


@pytest.mark.parametrize(
    "env_config, reason",
    [
        ({}, "env_config.reward_fn is missing: single_turn rows are scored by it"),
        ({"reward_fn": "no_such_module_xyz:score"},
         "env_config.reward_fn 'no_such_module_xyz:score' cannot be imported: ModuleNotFoundError: No module named 'no_such_module_xyz'"),
        ({"reward_fn": "math:no_such_function"}, "env_config.reward_fn 'math:no_such_function' cannot be imported: AttributeError"),
        ({"reward_fn": "math:pi"}, "env_config.reward_fn 'math:pi' is not callable"),
        ({"reward_fn": "no_colon"}, "env_config.reward_fn 'no_colon' must look like 'package.module:function'"),
    ],
)
def test_a_row_with_an_unusable_reward_fn_is_rejected_with_the_reason(env_config, reason):
    with pytest.raises(RowRejected) as info:
        adapt_row({"prompt": "Count!", "env_config": env_config}, "single_turn")
    assert str(info.value).startswith(reason)


def test_a_row_with_an_importable_reward_fn_is_accepted():
    task = adapt_row({"prompt": "Count!", "env_config": {"reward_fn": GOOD}}, "single_turn")
    assert task.env_config["reward_fn"] == GOOD and task.task_data["prompt"] == "Count!"


def test_intake_records_the_rejection_and_publishes_the_good_rows(redis_client, run_id, monkeypatch):
    for name in [n for n in os.environ if n.startswith("CONVEYOR_")]:
        monkeypatch.delenv(name)
    settings = Settings(run_id=run_id, rollout={"group_size": 2}, intake={"env_name": "single_turn", "env_config": {"reward_fn": GOOD}})
    rows = [
        Row("data.jsonl:1", {"prompt": "a"}),  # the settings' reward_fn
        Row("data.jsonl:2", {"prompt": "b", "env_config": {"reward_fn": "no_such_module_xyz:score"}}),
    ]
    published: list = []
    report = run_intake(settings, rows, redis_client, published.extend)
    assert [r.task.task_data["prompt"] for r in published] == ["a", "a"]
    assert report.rejected == [{"source": "data.jsonl:2", "reason": report.rejected[0]["reason"]}]
    assert report.rejected[0]["reason"].startswith("env_config.reward_fn 'no_such_module_xyz:score' cannot be imported")
    stored = [json.loads(x) for x in redis_client.lrange(RedisKeys.rejected_rows(run_id), 0, -1)]
    assert stored == report.rejected
