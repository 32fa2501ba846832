"""``scripts/stack.sh submit CONFIG``, ``logs RUN``, ``stop RUN`` and ``list``: a second run beside
the stack's own, as ``conveyor run submit`` in a detached container of the trainer's image; and
``ENV_DIR``, a stack's own settings folder. Compose is replaced by a recorder (nothing starts: the
live submit is ``tests/test_run_submit_e2e.py``, and ``tests/compose/test_compose_stack.py`` runs
docs/compose.md's lines on a live compose stack), so the tests check what the script asks compose
to run, and which settings reach ``conveyor run submit`` inside the container: the stack's
endpoints, never the stack's own run's settings, which would beat CONFIG's values."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from test_stack_script_down import checkout, stack_sh

__all__ = ["checkout"]  # the fixture, shared with the down tests

pytestmark = pytest.mark.timeout(60)


def test_submit_runs_conveyor_run_submit_detached_with_the_configs_folder_mounted(checkout: Path, tmp_path) -> None:
    config = tmp_path / "runs" / "mine.yaml"
    config.parent.mkdir()
    config.write_text("run_id: mine\n")
    [call] = stack_sh(checkout, "submit", str(config), "--resume")
    folder = config.parent
    assert f" run -d --rm --no-deps -v {folder}:{folder}:ro --entrypoint sh trainer -c " in call, call
    assert call.endswith(f'exec conveyor run submit "$@" submit {config} --resume'), call


def test_submit_publishes_the_runs_own_vllm_for_workers_on_other_hosts(checkout: Path, tmp_path) -> None:
    """``RUN_INFERENCE_PUBLISH=ADDRESS:PORT``: the submit container publishes PORT on the host's
    ADDRESS, and the run's own server listens on PORT and is named by ADDRESS."""
    config = tmp_path / "second.yaml"
    config.write_text("run_id: second\n")
    [call] = stack_sh(checkout, "submit", str(config), "--inference", "own", RUN_INFERENCE_PUBLISH="10.0.0.5:8100")
    assert " run -d --rm --no-deps -p 10.0.0.5:8100:8100 -v " in call, call
    assert call.endswith(f"submit {config} --inference own --inference-host 10.0.0.5 --inference-port 8100"), call
    with pytest.raises(subprocess.CalledProcessError) as refused:
        stack_sh(checkout, "submit", str(config), RUN_INFERENCE_PUBLISH="8100")
    assert refused.value.returncode == 2 and "expected ADDRESS:PORT" in refused.value.stderr


def test_logs_and_stop_run_in_a_container_of_the_stack(checkout: Path) -> None:
    [logs] = stack_sh(checkout, "logs", "mine", "--process", "trainer", "--follow")
    assert logs.endswith(" run --rm --no-deps -T trainer run logs mine --process trainer --follow"), logs
    [stop] = stack_sh(checkout, "stop", "mine", "--reason", "done")
    assert stop.endswith(" run --rm --no-deps -T trainer run stop mine --reason done"), stop
    [listing] = stack_sh(checkout, "list")
    assert listing.endswith(" run --rm --no-deps -T trainer run list"), listing


def test_env_dir_gives_a_second_stack_its_own_settings(checkout: Path, tmp_path) -> None:
    """``ENV_DIR``: the stack's settings come from ``ENV_DIR/.env``, and what the script derives
    from them is written beside it, not into compose/."""
    other = tmp_path / "other"
    other.mkdir()
    (other / ".env").write_text("REDIS_PASSWORD=other-secret\n")
    (other / "images.env").write_text("CONVEYOR_SERVICE_IMAGE=other:test\n")
    [call] = stack_sh(checkout, "list", ENV_DIR=str(other), PROJECT="other")
    assert f"-p other --env-file {other}/.stack.env " in call, call
    assert (other / ".stack.env").read_text().startswith("REDIS_PASSWORD=other-secret\nCONVEYOR_SERVICE_IMAGE=other:test\n")
    assert not (checkout / "compose" / ".stack.env").exists()


def test_settings_that_put_the_ledger_on_the_cluster_add_its_profile_to_every_compose_call(checkout: Path, tmp_path) -> None:
    """docs/compose.md, "Redis Cluster": with ``LEDGER_REDIS_SCHEME=redis+cluster`` in the
    settings, the `cluster` profile's nodes are part of the stack (up to `down`); without, not."""
    for scheme, profiles in (("redis+cluster", "--profile cpu --profile cluster "), ("redis", "--profile cpu run ")):
        folder = tmp_path / scheme
        folder.mkdir()
        (folder / ".env").write_text(f"REDIS_PASSWORD=secret\nLEDGER_REDIS_SCHEME={scheme}\n")
        (folder / "images.env").write_text("CONVEYOR_SERVICE_IMAGE=other:test\n")
        [call] = stack_sh(checkout, "list", ENV_DIR=str(folder))
        assert profiles in call, call


def test_inside_the_container_only_the_stacks_endpoints_reach_run_submit(checkout: Path, tmp_path) -> None:
    fake_conveyor = tmp_path / "bin" / "conveyor"  # prints what the real one would be given
    fake_conveyor.parent.mkdir()
    fake_conveyor.write_text('#!/bin/sh\nenv | grep "^CONVEYOR_" | sort\necho "argv: $*"\n')
    fake_conveyor.chmod(0o755)
    service_env = {"CONVEYOR_RUN_ID": "demo", "CONVEYOR_TRAINER__MAX_STEPS": "8", "CONVEYOR_ROLLOUT__GROUP_SIZE": "4",
                   "CONVEYOR_METRICS_PORT": "9100", "CONVEYOR_INFERENCE__MODEL_PATH": "/models/tiny",
                   "CONVEYOR_REDIS__URL": "redis://redis:6379/0", "CONVEYOR_STORAGE__ENDPOINT": "s3:9000",
                   "CONVEYOR_INFERENCE__BASE_URL": "http://inference:8000", "CONVEYOR_INFERENCE__MODEL": "tiny",
                   "CONVEYOR_STACK_ID": "conveyor-1", "CONVEYOR_RUNS_DIR": "/data/runs"}
    script = checkout / "scripts" / "stack.sh"
    shown = subprocess.run(
        ["bash", "-c", f'eval "$(grep -E "^SUBMIT_(KEEPS|IN_CONTAINER)=" {script})"; '
                       'exec sh -c "$SUBMIT_IN_CONTAINER" submit /runs/mine.yaml --resume'],
        env={"PATH": f"{fake_conveyor.parent}:/usr/bin:/bin", **service_env}, capture_output=True, text=True, check=True,
    ).stdout.splitlines()
    assert shown == ["CONVEYOR_INFERENCE__BASE_URL=http://inference:8000", "CONVEYOR_INFERENCE__MODEL=tiny",
                     "CONVEYOR_REDIS__URL=redis://redis:6379/0", "CONVEYOR_RUNS_DIR=/data/runs",
                     "CONVEYOR_STACK_ID=conveyor-1", "CONVEYOR_STORAGE__ENDPOINT=s3:9000",
                     "argv: run submit /runs/mine.yaml --resume"]
