"""Intake never skips rows silently and never waits without saying why (issue 24): a run id
already in Redis is refused unless ``--resume`` is given, and a wait on the staleness bound is
logged with its reasons. Real Redis, the real ``conveyor`` command."""

from __future__ import annotations

import logging
import threading
import time

from services.intake.datasets import Row
from services.intake.publisher import run_intake
from shared.ledger import Ledger
from shared.names import RedisKeys
from shared.settings import Settings
from shared.staleness import StalenessBudget
from shared.trainer_reads import TRAINER_CONSUMER_GROUP


def test_intake_held_by_the_staleness_bound_says_why(redis_client, redis_url, run_id, caplog):
    settings = Settings(run_id=run_id, redis={"url": redis_url}, rollout={"group_size": 2},
                        trainer={"max_off_policy_steps": 0, "groups_per_step": 1}, intake={"wait_log_every_s": 0.2})
    rows = [Row(f"mem:{i}", {"task_data": {"low": 1, "high": 9, "target": 5}}) for i in range(2)]
    caplog.set_level(logging.INFO, logger="services.intake.admission_wait")
    intake = threading.Thread(target=run_intake, args=(settings, rows, Ledger(redis_client), lambda _requests: None))
    intake.start()
    time.sleep(0.8)  # lines at 0.2 s and 0.6 s, the next not before 1.4 s: doubling intervals, no flood
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"intake of run {run_id} waiting 0s to publish its next group: 1 groups held")
    assert "staleness bound of 1 = (trainer.max_off_policy_steps 0 + step 0 + 1) x trainer.groups_per_step 1" in lines[0]
    assert "2 queued, 0 running" in lines[0] and "the trainer consumed 0 trajectories and advanced 0 steps" in lines[0]
    assert f"no trainer has started for run {run_id}" in lines[0]

    stream = RedisKeys.trainer_stream(run_id)  # a trainer that read once, then stopped while events came in
    redis_client.xgroup_create(stream, TRAINER_CONSUMER_GROUP, id="$", mkstream=True)
    redis_client.xadd(stream, {"event": "{}"})
    time.sleep(1.0)
    assert "the oldest event of run" in caplog.records[-1].getMessage()
    assert "no trainer is reading the run unless one is in a training step that long" in caplog.records[-1].getMessage()

    StalenessBudget(redis_client, run_id, 0, 1).advance_step(1)
    redis_client.set(RedisKeys.policy_version(run_id), 1)
    intake.join(10)
    assert not intake.is_alive()
    assert "the staleness bound admits groups again after" in caplog.records[-1].getMessage()
