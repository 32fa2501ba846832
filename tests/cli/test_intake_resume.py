"""Intake never skips rows silently and never waits without saying why (issue 24): a run id
already in Redis is refused unless ``--resume`` is given, and a wait on the staleness bound is
logged with its reasons. Real Redis, the real ``conveyor`` command."""

from __future__ import annotations

import logging
import threading
import time

from services.intake.admission_wait import AdmissionWait, WaitStart
from services.intake.datasets import Row
from services.intake.publisher import run_intake
from shared.state.group_registry import GroupRegistry
from shared.state.ledger import Ledger
from shared.names import ROLLOUT_QUEUE, RedisKeys
from shared.settings import Settings
from shared.state.staleness import StalenessBudget
from shared.state.trainer_reads import TRAINER_CONSUMER_GROUP
from test_cli_errors import conveyor, one_error_line


def _intake(tmp_path, redis_url, run_id, tasks: int, *flags: str):
    env = {"CONVEYOR_REDIS__URL": redis_url, "CONVEYOR_RUN_ID": run_id, "CONVEYOR_STORAGE__BACKEND": "local",
           "CONVEYOR_STORAGE__LOCAL_ROOT": str(tmp_path / "objects")}
    return conveyor("intake", "--demo-tasks", str(tasks), *flags, cwd=tmp_path, **env)


def test_a_run_id_in_use_is_refused_without_resume_and_nothing_is_published(redis_url, redis_client, tmp_path, run_id):
    assert _intake(tmp_path, redis_url, run_id, 2).returncode == 0
    states, queued = Ledger(redis_client).states(run_id), redis_client.llen(ROLLOUT_QUEUE)
    assert len(states) == 2 * 4 and queued == 2  # group_size 4, one task per group

    line = one_error_line(_intake(tmp_path, redis_url, run_id, 4))
    assert line.startswith(f"run {run_id} is already in Redis: 2 groups (2 published), trajectories: 8 queued.")
    assert "--resume" in line and "CONVEYOR_RUN_ID" in line and "run_id in the --config file" in line
    assert Ledger(redis_client).states(run_id) == states and redis_client.llen(ROLLOUT_QUEUE) == queued
    assert GroupRegistry(redis_client, run_id).registered_count() == 2


def test_resume_skips_the_published_groups_and_publishes_the_rest(redis_url, redis_client, tmp_path, run_id):
    assert _intake(tmp_path, redis_url, run_id, 2).returncode == 0
    resumed = _intake(tmp_path, redis_url, run_id, 4, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "2 groups, 8 trajectories published, 2 already published (skipped)" in resumed.stderr
    assert GroupRegistry(redis_client, run_id).published_count() == 4 and redis_client.llen(ROLLOUT_QUEUE) == 4
    fresh = _intake(tmp_path, redis_url, run_id + "b", 1)  # a new run id needs no flag
    assert fresh.returncode == 0 and "1 groups, 4 trajectories published, 0 already published" in fresh.stderr


def test_intake_held_by_the_staleness_bound_says_why(redis_client, redis_url, run_id, caplog):
    settings = Settings(run_id=run_id, redis={"url": redis_url}, rollout={"group_size": 2},
                        trainer={"max_off_policy_steps": 0, "groups_per_step": 1}, intake={"wait_log_every_s": 0.2})
    rows = [Row(f"mem:{i}", {"task_data": {"low": 1, "high": 9, "target": 5}}) for i in range(2)]
    caplog.set_level(logging.INFO, logger="services.intake.admission_wait")
    intake = threading.Thread(target=run_intake, args=(settings, rows, redis_client, lambda _requests: None))
    intake.start()
    time.sleep(0.8)  # lines at 0.2 s and 0.6 s, the next not before 1.4 s: doubling intervals, no flood
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"intake of run {run_id} waiting 0s to publish its next group: 1 groups held")
    assert "staleness bound of 1 = (trainer.max_off_policy_steps 0 + step 0 + 1) x trainer.groups_per_step 1" in lines[0]
    assert "2 queued, 0 running" in lines[0] and "the trainer consumed 0 trajectories and advanced 0 steps" in lines[0]
    assert f"no trainer has read run {run_id}'s events yet" in lines[0] and "none was started with this run id" in lines[0]

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


def test_the_wait_line_names_a_weight_sync_that_holds_the_bound(redis_client, run_id):
    budget = StalenessBudget(redis_client, run_id, max_off_policy_steps=0, groups_per_step=1)
    assert budget.try_admit() and not budget.try_admit()
    budget.advance_step(1)  # trained, not yet served: the bound stays at step 0
    wait = AdmissionWait(budget, redis_client, log_every_s=10)
    line = wait.why(WaitStart(time.monotonic() - 30, consumed=0, trainer_step=0), time.monotonic())
    assert f"intake of run {run_id} waiting 30s" in line and "+ step 0 + 1)" in line
    assert "advanced 1 steps (now at step 1)" in line
    assert "serves policy version 0, behind trainer step 1: the bound waits for the weight sync" in line


def _published_requests(redis_client) -> list[dict]:
    """The rollout requests in the queue's Celery messages (protocol 2: base64 body [args, kwargs, embed])."""
    import base64
    import json

    messages = [json.loads(m) for m in redis_client.lrange(ROLLOUT_QUEUE, 0, -1)]
    bodies = [json.loads(base64.b64decode(m["body"])) for m in messages]
    return [request for args, _kwargs, _embed in bodies for request in args[0]]


def test_the_digit_demo_publishes_the_toy_task_and_a_wrong_demo_is_one_line(redis_url, redis_client, tmp_path, run_id):
    """``--demo digits`` (compose's demo, which the tiny model learns) publishes the toy task's
    prompts in the single_turn environment with its reward function; ``--demo guess`` stays the default."""
    from services.cli.demo import TOY_REWARD_FN

    assert _intake(tmp_path, redis_url, run_id, 2, "--demo", "digits").returncode == 0
    requests = _published_requests(redis_client)
    assert len(requests) == 2 * 4
    tasks = [r["task"] for r in requests]
    assert {(t["env_name"], t["env_config"]["reward_fn"]) for t in tasks} == {("single_turn", TOY_REWARD_FN)}
    assert {t["task_data"]["prompt"] for t in tasks} == {"Write some numbers, please (0).",
                                                            "Write some numbers, please (1)."}
    line = one_error_line(_intake(tmp_path, redis_url, run_id + "x", 2, "--demo", "chess"))
    assert line == "--demo must be 'guess' or 'digits', got 'chess'", line
