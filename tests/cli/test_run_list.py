"""``conveyor run list``: the runs in Redis, each with its groups, its trajectories by state, its
trainer and its served version. Real Redis, the real ``conveyor`` command; the run with a
running trainer is checked in ``tests/test_pipeline_e2e.py``."""

from __future__ import annotations

import json

from shared.names import RedisKeys
from shared.state.trainer_reads import TRAINER_CONSUMER_GROUP
from test_cli_errors import conveyor, one_error_line


def _env(tmp_path, redis_url, run_id):
    return {"CONVEYOR_REDIS__URL": redis_url, "CONVEYOR_RUN_ID": run_id, "CONVEYOR_STORAGE__BACKEND": "local",
            "CONVEYOR_STORAGE__LOCAL_ROOT": str(tmp_path / "objects")}


def _listed(tmp_path, redis_url, run_id) -> dict:
    done = conveyor("run", "list", "--json", "--run", run_id, cwd=tmp_path, **_env(tmp_path, redis_url, run_id))
    assert done.returncode == 0, done.stderr
    [summary] = json.loads(done.stdout)["runs"]
    return summary


def test_a_published_run_with_no_trainer_says_so_and_a_trainer_that_stopped_reading_is_named(
        redis_url, redis_client, tmp_path, run_id):
    env = _env(tmp_path, redis_url, run_id)
    assert conveyor("intake", "--demo-tasks", "3", cwd=tmp_path, **env).returncode == 0
    summary = _listed(tmp_path, redis_url, run_id)
    assert (summary["run_id"], summary["groups_published"], summary["groups_done"]) == (run_id, 3, 0)
    assert summary["trajectories"]["queued"] == 12 and sum(summary["trajectories"].values()) == 12
    assert (summary["trainer"], summary["trainer_step"], summary["served_version"]) == ("not started", None, 0)

    # a trainer's group whose oldest unread event has waited past the bound: it is not reading
    stream = RedisKeys.trainer_stream(run_id)
    redis_client.xgroup_create(stream, TRAINER_CONSUMER_GROUP, id="$", mkstream=True)
    seconds, _ = redis_client.time()
    redis_client.xadd(stream, {"event": "{}"}, id=f"{(seconds - 300) * 1000}-0")  # added 300 s ago, never read
    assert _listed(tmp_path, redis_url, run_id)["trainer"].startswith("not reading for 30")
    redis_client.xadd(stream, {"event": "{}"})
    redis_client.xreadgroup(TRAINER_CONSUMER_GROUP, "t", {stream: ">"}, count=1)  # the old one read: the next is fresh
    assert _listed(tmp_path, redis_url, run_id)["trainer"] == "reading"
    table = conveyor("run", "list", cwd=tmp_path, **env)
    assert table.returncode == 0 and run_id in table.stdout and "12 queued" in table.stdout, table.stdout


def test_an_unknown_run_is_one_error_line_naming_the_runs_there(redis_url, tmp_path, run_id):
    env = _env(tmp_path, redis_url, run_id)
    assert conveyor("intake", "--demo-tasks", "1", cwd=tmp_path, **env).returncode == 0
    line = one_error_line(conveyor("run", "list", "--run", "nosuchrun", cwd=tmp_path, **env))
    assert line.startswith("Redis holds no run 'nosuchrun' (runs: ") and run_id in line
