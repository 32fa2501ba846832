"""``conveyor run stop RUN``: the run ends, nothing of it stays queued, a second stop says so, and
a stopped run cannot be resumed nor its failures retried. Real Redis, the real ``conveyor`` command; the stop of a run
with its workers and trainer running is in ``tests/test_run_stop_e2e.py``."""

from __future__ import annotations

import json
import threading

from services.intake.datasets import Row
from services.intake.publisher import run_intake
from shared.state.ledger import Ledger
from shared.names import RedisKeys
from shared.state.run_stop import request_stop, stop_of
from shared.settings import Settings
from test_cli_errors import conveyor, one_error_line


def _env(tmp_path, redis_url, run_id):
    return {"CONVEYOR_REDIS__URL": redis_url, "CONVEYOR_RUN_ID": run_id, "CONVEYOR_STORAGE__BACKEND": "local",
            "CONVEYOR_STORAGE__LOCAL_ROOT": str(tmp_path / "objects")}


def _rows(n: int) -> list[Row]:
    return [Row(f"mem:{i}", {"task_data": {"low": 1, "high": 9, "target": 5}}) for i in range(n)]


def test_an_unknown_run_is_one_error_line(redis_url, tmp_path, run_id):
    env = _env(tmp_path, redis_url, run_id)
    assert conveyor("intake", "--demo-tasks", "1", cwd=tmp_path, **env).returncode == 0
    line = one_error_line(conveyor("run", "stop", "nosuchrun", cwd=tmp_path, **env))
    assert line.startswith("Redis holds no run 'nosuchrun' (runs: ") and run_id in line


def test_stop_fails_the_queued_trajectories_once_is_idempotent_and_refuses_a_resume(redis_url, redis_client, tmp_path,
                                                                                     run_id):
    env = _env(tmp_path, redis_url, run_id)
    assert conveyor("intake", "--demo-tasks", "3", cwd=tmp_path, **env).returncode == 0
    first = conveyor("run", "stop", run_id, "--reason", "bad learning rate", cwd=tmp_path, **env)
    assert first.returncode == 0, first.stderr
    assert f"run {run_id} stopped by " in first.stdout and ": bad learning rate; 12 unfinished trajectories failed now" \
        in first.stdout, first.stdout
    ledger = Ledger(redis_client)
    assert ledger.counts(run_id)["failed"] == 12 and sum(ledger.counts(run_id).values()) == 12
    reasons = set(ledger.failure_reasons(run_id).values())
    assert len(reasons) == 1 and next(iter(reasons)).startswith("run_stopped: bad learning rate (by "), reasons

    again = conveyor("run", "stop", run_id, "--reason", "another reason", cwd=tmp_path, **env)
    assert again.returncode == 0, again.stderr
    assert f"run {run_id} was already stopped by " in again.stdout and ": bad learning rate; 0 unfinished" in again.stdout

    listed = conveyor("run", "list", "--json", "--run", run_id, cwd=tmp_path, **env)
    [summary] = json.loads(listed.stdout)["runs"]
    assert summary["stopped"].startswith("stopped by ") and summary["stopped"].endswith(": bad learning rate")
    table = conveyor("run", "list", cwd=tmp_path, **env)
    assert table.returncode == 0 and "stopped by" in table.stdout, table.stdout  # the column wraps the rest

    for flags in (["--resume"], []):
        line = one_error_line(conveyor("intake", "--demo-tasks", "4", *flags, cwd=tmp_path, **env))
        assert line.startswith(f"run {run_id} was stopped by ") and "a stopped run is over: set a new run id" in line
    line = one_error_line(conveyor("retry", run_id, cwd=tmp_path, **env))
    assert line.startswith(f"run {run_id} was stopped by ") and "its failures stay as they are" in line
    assert sum(ledger.counts(run_id).values()) == ledger.counts(run_id)["failed"] == 12  # nothing published or queued again


def test_intake_publishes_no_group_after_the_stop(redis_client, redis_url, run_id):
    settings = Settings(run_id=run_id, redis={"url": redis_url}, rollout={"group_size": 2})
    published: list[int] = []

    def publish(requests):
        published.append(requests[0].group_id)
        if len(published) == 2:
            request_stop(redis_client, run_id, "enough")

    report = run_intake(settings, _rows(5), redis_client, publish)
    assert published == [0, 1] and report.groups == 2 and report.stopped.endswith(": enough")
    assert redis_client.get(RedisKeys.intake_done(run_id)) == "1"


def test_a_stop_ends_intakes_wait_on_the_staleness_bound(redis_client, redis_url, run_id):
    settings = Settings(run_id=run_id, redis={"url": redis_url}, rollout={"group_size": 2},
                        trainer={"max_off_policy_steps": 0, "groups_per_step": 1})
    reports = []
    intake = threading.Thread(target=lambda: reports.append(run_intake(settings, _rows(3), redis_client,
                                                                       lambda _requests: None)))
    intake.start()
    intake.join(0.8)
    assert intake.is_alive()  # no trainer: the second group waits on the bound
    request_stop(redis_client, run_id, "no trainer came")
    intake.join(5)
    assert not intake.is_alive() and reports[0].groups == 1 and stop_of(redis_client, run_id).reason == "no trainer came"


def test_who_stopped_a_run_is_named_even_for_a_user_with_no_login_name(monkeypatch):
    """A container's user often has no passwd entry (compose runs the services as uid 10001)."""
    import getpass

    from shared.state import run_stop

    def no_passwd_entry() -> str:
        raise KeyError("getpwuid(): uid not found: 10001")

    monkeypatch.setattr(getpass, "getuser", no_passwd_entry)
    assert run_stop._user().startswith("uid ")
