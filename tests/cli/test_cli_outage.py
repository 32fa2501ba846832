"""Services wait for a dependency that is down, at start as in the middle of a run, and give up
only past ``outage.limit_s``: then one ``error:`` line naming the dependency and the setting,
and exit code 2. Real ``conveyor`` processes, a real redis-server started late."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

from cli.test_cli_errors import CONVEYOR, closed_port_url, conveyor

from services.cli.local_stack import free_port


def _waited_then_gave_up(result: subprocess.CompletedProcess, dependency: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert any(f"{dependency} is unreachable" in line and "waiting for it" in line for line in lines), result.stderr
    assert "Traceback" not in result.stderr
    assert lines[-1].startswith(f"error: {dependency} has been unreachable for "), result.stderr
    assert "longer than outage.limit_s (2s)" in lines[-1]
    return lines[-1]


def test_a_worker_waits_for_redis_at_start_and_gives_up_past_the_limit(tmp_path):
    url = closed_port_url("s3cret-pw")
    started = time.monotonic()
    result = conveyor("worker", "scoring", cwd=tmp_path, CONVEYOR_REDIS__URL=url, CONVEYOR_OUTAGE__LIMIT_S="2")
    assert time.monotonic() - started >= 2
    line = _waited_then_gave_up(result, f"Redis at {url.replace('s3cret-pw', '***')}")
    assert "Connection refused" in line and "s3cret-pw" not in result.stderr


def test_the_trainer_waits_for_s3_and_gives_up_past_the_limit(tmp_path, redis_url):
    endpoint = f"127.0.0.1:{free_port()}"
    result = conveyor("trainer", cwd=tmp_path, CONVEYOR_REDIS__URL=redis_url, CONVEYOR_STORAGE__ENDPOINT=endpoint,
                      CONVEYOR_OUTAGE__LIMIT_S="2")
    assert "Connection refused" in _waited_then_gave_up(result, f"S3 server at {endpoint}")


def test_a_worker_started_before_redis_goes_to_work_when_redis_comes(tmp_path):
    port = free_port()
    env = {"CONVEYOR_REDIS__URL": f"redis://127.0.0.1:{port}/0", "CONVEYOR_STORAGE__BACKEND": "local",
           "CONVEYOR_STORAGE__LOCAL_ROOT": str(tmp_path / "objects")}
    log = tmp_path / "worker.log"
    base = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    with log.open("w") as out:
        worker = subprocess.Popen([CONVEYOR, "worker", "scoring", "--name", "late"], cwd=tmp_path, env={**base, **env},
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    redis_server = None
    try:
        time.sleep(3)
        assert worker.poll() is None and "is unreachable" in log.read_text()
        redis_server = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                         "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        # "back" is said once Redis stayed up outage.backoff_max_s + 1 s (shared.outage)
        while any(text not in log.read_text() for text in ("late@", "ready.", "is back after")):
            assert worker.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
    finally:
        worker.terminate()
        worker.wait(30)
        if redis_server:
            redis_server.terminate()
            redis_server.wait(10)
