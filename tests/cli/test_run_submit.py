"""``conveyor run submit CONFIG`` refuses a run it cannot start before it starts or writes
anything, names a process of the run that fails, and on SIGTERM stops the run's processes;
``conveyor run logs`` says where it looked when a run has no logs here, and follows logs a whole
line at a time. Real Redis, the real ``conveyor`` command; a submitted run that goes to its end
is in ``tests/test_run_submit_e2e.py``."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from pipeline_support import process_running

from shared.settings import load_settings
from shared.state.ledger import Ledger
from shared.names import ROLLOUT_QUEUE
from test_cli_errors import CONVEYOR, conveyor, one_error_line

GOOD_ROW = {"task_data": {"low": 1, "high": 20, "target": 3}}


def _config(tmp_path: Path, run_id: str, rows: list[dict], more: str = "") -> Path:
    dataset = tmp_path / "tasks.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = tmp_path / "run.yaml"
    config.write_text(f"run_id: {run_id}\nruns_dir: {tmp_path / 'runs'}\nintake:\n  dataset: {dataset}\n"
                      f"storage:\n  backend: local\n  local_root: {tmp_path / 'objects'}\n{more}")
    return config


def test_a_bad_row_is_one_error_naming_file_row_and_field_and_nothing_starts(redis_url, redis_client, tmp_path, run_id):
    config = _config(tmp_path, run_id, [GOOD_ROW, {"task_data": {"low": 1, "high": 20}}, GOOD_ROW])
    line = one_error_line(conveyor("run", "submit", str(config), cwd=tmp_path, CONVEYOR_REDIS__URL=redis_url))
    assert line.startswith(f"{tmp_path / 'tasks.jsonl'}:2: field target: field 'target' must be an integer"), line
    assert line.endswith("(1 of 3 rows rejected; `conveyor data validate "
                         f"{tmp_path / 'tasks.jsonl'}` lists them); nothing was started")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "objects").exists()
    assert Ledger(redis_client).runs() == [] and redis_client.dbsize() == 0


def test_a_run_id_in_use_is_refused_without_resume_by_intakes_own_check(redis_url, redis_client, tmp_path, run_id):
    env = {"CONVEYOR_REDIS__URL": redis_url, "CONVEYOR_RUN_ID": run_id, "CONVEYOR_STORAGE__BACKEND": "local",
           "CONVEYOR_STORAGE__LOCAL_ROOT": str(tmp_path / "objects")}
    assert conveyor("intake", "--demo-tasks", "2", cwd=tmp_path, **env).returncode == 0
    states, queued = Ledger(redis_client).states(run_id), redis_client.llen(ROLLOUT_QUEUE)

    config = _config(tmp_path, run_id, [GOOD_ROW])
    line = one_error_line(conveyor("run", "submit", str(config), cwd=tmp_path, CONVEYOR_REDIS__URL=redis_url))
    assert line.startswith(f"run {run_id} is already in Redis: 2 groups (2 published), trajectories: 8 queued.")
    assert "Pass --resume to continue it" in line
    assert not (tmp_path / "runs").exists()
    assert Ledger(redis_client).states(run_id) == states and redis_client.llen(ROLLOUT_QUEUE) == queued


def test_logs_of_a_run_with_none_here_say_where_they_looked(tmp_path):
    line = one_error_line(conveyor("run", "logs", "norun", cwd=tmp_path, CONVEYOR_RUNS_DIR=str(tmp_path / "runs")))
    assert line.startswith(f"run norun has no logs on this host: looked in {tmp_path / 'runs' / 'norun' / 'logs'} ")


@pytest.mark.slow  # three conveyor processes start, one loads torch: about 20 s
def test_a_failing_process_is_named_with_its_log_and_ends_the_runs_others(redis_url, tmp_path, run_id):
    (tmp_path / "model").mkdir()  # no checkpoint in it: the weight follower cannot load the run's base model
    config = _config(tmp_path, run_id, [GOOD_ROW], f"inference:\n  model_path: {tmp_path / 'model'}\n"
                                                  "  base_url: http://127.0.0.1:9\n")
    failed = conveyor("run", "submit", str(config), cwd=tmp_path, timeout_s=180, CONVEYOR_REDIS__URL=redis_url)
    assert failed.returncode == 1, (failed.stdout, failed.stderr)
    started = dict(re.findall(r"^run \S+: started (\w+) \(pid (\d+)\)", failed.stdout, re.M))
    assert sorted(started) == ["follower", "intake", "trainer"], failed.stdout
    log = tmp_path / "runs" / run_id / "logs" / "follower.log"
    assert failed.stderr.startswith(f"run {run_id}: follower exited with 1; stopping the run's other processes. "
                                    f"The last lines of {log}:\n"), failed.stderr
    assert f"Unrecognized model in {tmp_path / 'model'}" in failed.stderr.replace("\n", "")
    assert not any(process_running(int(pid)) for pid in started.values())


def test_logs_follow_prints_whole_new_lines_prefixed_by_process_until_ctrl_c(tmp_path):
    folder = tmp_path / "runs" / "r1" / "logs"
    folder.mkdir(parents=True)
    (folder / "intake.log").write_text("intake r1: publishing\n")
    trainer = folder / "trainer.log"
    trainer.write_text("old line\ntrainer r1: reading\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")},
           "CONVEYOR_RUNS_DIR": str(tmp_path / "runs")}
    follow = subprocess.Popen([CONVEYOR, "run", "logs", "r1", "--follow", "--lines", "1"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert follow.stdout.readline() == "[intake] intake r1: publishing\n"
        assert follow.stdout.readline() == "[trainer] trainer r1: reading\n"
        with trainer.open("a") as log:
            log.write("step 1 ")  # half a line: held back until its end comes
            log.flush()
            time.sleep(1.0)
            log.write("done\n")
        assert follow.stdout.readline() == "[trainer] step 1 done\n"
    finally:
        follow.send_signal(signal.SIGINT)
        assert follow.wait(10) == 0, follow.stderr.read()


def test_sigterm_stops_the_runs_processes_and_says_so(redis_url, tmp_path, run_id):
    with socket.socket() as hung_inference:  # accepts connections, never answers: the follower waits on it
        hung_inference.bind(("127.0.0.1", 0))
        hung_inference.listen(8)
        (tmp_path / "model").mkdir()
        config = _config(tmp_path, run_id, [GOOD_ROW], f"inference:\n  model_path: {tmp_path / 'model'}\n"
                                                      f"  base_url: http://127.0.0.1:{hung_inference.getsockname()[1]}\n")
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}, "CONVEYOR_REDIS__URL": redis_url}
        supervisor = subprocess.Popen([CONVEYOR, "run", "submit", str(config)], cwd=tmp_path, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started = {}
        while len(started) < 3:
            line = supervisor.stdout.readline()
            assert line, supervisor.stderr.read()
            if found := re.match(r"run \S+: started (\w+) \(pid (\d+)\)", line):
                started[found[1]] = int(found[2])
            else:  # the one line before: which inference server the run takes
                assert not started and line.startswith(f"run {run_id}: on the shared inference server(s) "), line
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(60) == 128 + signal.SIGTERM, supervisor.stderr.read()
    rest = supervisor.stdout.read()
    assert rest.splitlines()[-1] == f"run {run_id}: terminated (SIGTERM); stopping its processes (the stack stays up)"
    assert not any(process_running(pid) for pid in started.values())


def test_a_submitted_run_shares_the_queue_unless_its_config_says_how(tmp_path):
    from services.cli.run_submit import SUBMITTED_RUN_QUEUED_GROUPS, queue_share_env

    env = queue_share_env(load_settings())
    assert env == {"CONVEYOR_INTAKE__MAX_QUEUED_GROUPS": str(SUBMITTED_RUN_QUEUED_GROUPS)}
    config = tmp_path / "run.yaml"
    config.write_text("run_id: shared-queue\n")
    with pytest.MonkeyPatch.context() as patch:  # the env reaches intake's settings over the config file
        for name, value in {**env, "CONVEYOR_CONFIG": str(config)}.items():
            patch.setenv(name, value)
        assert load_settings().intake.max_queued_groups == SUBMITTED_RUN_QUEUED_GROUPS
    assert queue_share_env(load_settings(intake={"max_queued_groups": 3})) == {}
