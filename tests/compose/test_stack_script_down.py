"""``scripts/stack.sh down`` stops the worker-host projects this checkout started on this daemon:
the ones ``worker-host`` recorded, and ones started before the record existed, found by the
labels compose puts on their containers. Compose itself is replaced by a recorder (nothing
starts), so the test checks what the script asks compose to do; each project gets the stack id
of its own project and checkout."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import uuid
from pathlib import Path

import docker
import pytest

from compose_support import ROOT
from services.rollout_worker.sandbox.images import build_busybox_image

pytestmark = [pytest.mark.docker, pytest.mark.timeout(60)]


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A checkout holding only what ``stack.sh`` reads, and a compose that records its calls."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "compose").mkdir()
    shutil.copy(ROOT / "scripts" / "stack.sh", tmp_path / "scripts" / "stack.sh")
    shutil.copy(ROOT / "compose" / ".env.example", tmp_path / "compose" / ".env")
    (tmp_path / "compose" / "images.env").write_text("CONVEYOR_SERVICE_IMAGE=unused:test\nCONVEYOR_WORKER_IMAGE=unused:test\n")
    recorder = tmp_path / "record-compose"
    recorder.write_text('#!/bin/sh\necho "$*" >> "$(dirname "$0")/compose-calls"\n')
    recorder.chmod(recorder.stat().st_mode | stat.S_IXUSR)
    return tmp_path


def stack_sh(checkout: Path, *args: str, **env: str) -> list[str]:
    """Run ``scripts/stack.sh``; returns the compose calls it made (``-p <project> ... <command>``)."""
    calls = checkout / "compose-calls"
    calls.unlink(missing_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    subprocess.run(["bash", str(checkout / "scripts" / "stack.sh"), *args], check=True, capture_output=True, text=True,
                   env={**base, "COMPOSE": str(checkout / "record-compose"), "PY": "true", **env}, timeout=30)
    return calls.read_text().splitlines() if calls.exists() else []


def project_of(call: str) -> str:
    argv = call.split()
    return argv[argv.index("-p") + 1]


def test_down_stops_the_worker_hosts_this_checkout_started_then_the_head(checkout: Path) -> None:
    head = {"CONVEYOR_HEAD": "10.0.0.5"}
    init, up = stack_sh(checkout, "worker-host", "--scale", "rollout-worker=4", **head)  # docs/compose.md's line
    assert "-f compose/worker-host.yml" in init and init.endswith(" run --rm model-init"), init
    assert up.endswith(" up -d --no-deps --scale rollout-worker=4 rollout-worker"), up
    stack_sh(checkout, "worker-host", PROJECT="conveyor-workers-b", **head)
    assert (checkout / "compose" / ".worker-hosts").read_text().split() == ["conveyor-workers", "conveyor-workers-b"]
    stack_ids = {line for line in (checkout / "compose" / ".stack.env").read_text().splitlines()
                 if line.startswith("CONVEYOR_STACK_ID=")}
    assert len(stack_ids) == 1 and stack_ids.pop().startswith("CONVEYOR_STACK_ID=conveyor-workers-b-")

    # a worker-host project started before the record existed: only compose's labels tell
    unrecorded = f"stkidtest{uuid.uuid4().hex[:6]}"
    client = docker.from_env()
    container = client.api.create_container(build_busybox_image(client), command=["true"], labels={
        "com.docker.compose.project": unrecorded,
        "com.docker.compose.project.working_dir": f"{checkout.resolve()}/compose",
        "com.docker.compose.project.config_files": "compose/docker-compose.yml,compose/worker-host.yml"})["Id"]
    try:
        calls = stack_sh(checkout, "down", "-v")
    finally:
        client.api.remove_container(container, force=True)
    assert [project_of(c) for c in calls] == ["conveyor-workers", "conveyor-workers-b", unrecorded, "conveyor"]
    assert all(c.endswith("down -v") and "worker-host.yml" not in c for c in calls)
    assert (checkout / "compose" / ".worker-hosts").read_text() == ""
    assert stack_sh(checkout, "down") and project_of(stack_sh(checkout, "down")[0]) == "conveyor"


def test_a_worker_hosts_own_down_stops_only_itself(checkout: Path) -> None:
    stack_sh(checkout, "worker-host", CONVEYOR_HEAD="10.0.0.5")
    stack_sh(checkout, "worker-host", PROJECT="conveyor-workers-b", CONVEYOR_HEAD="10.0.0.5")
    calls = stack_sh(checkout, "down", PROJECT="conveyor-workers-b")
    assert [project_of(c) for c in calls] == ["conveyor-workers-b"]
    assert (checkout / "compose" / ".worker-hosts").read_text().split() == ["conveyor-workers"]


def test_two_checkouts_and_two_projects_get_different_stack_ids(checkout: Path, tmp_path_factory) -> None:
    other = tmp_path_factory.mktemp("other-checkout")
    shutil.copytree(checkout, other, dirs_exist_ok=True)

    def stack_id(where: Path, **env: str) -> str:
        stack_sh(where, "env", **env)
        return next(line.split("=", 1)[1] for line in (where / "compose" / ".stack.env").read_text().splitlines()
                    if line.startswith("CONVEYOR_STACK_ID="))

    ids = {stack_id(checkout), stack_id(other), stack_id(checkout, PROJECT="conveyor-b")}
    assert len(ids) == 3 and stack_id(checkout) in ids
    assert stack_id(checkout, CONVEYOR_STACK_ID="mine") == "mine"


def test_scale_starts_only_rollout_workers_never_the_one_shot_intake_or_trainer_again(checkout: Path) -> None:
    [call] = stack_sh(checkout, "scale", "3")
    argv = call.split()
    assert argv[argv.index("up"):] == ["up", "-d", "--no-deps", "--no-recreate", "--scale", "rollout-worker=3",
                                       "rollout-worker"]
