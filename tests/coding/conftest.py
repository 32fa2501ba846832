"""Fixtures for the coding environment tests: Docker, the Python image, a git fixture repository.

The fixture repository is a tiny package ``calc`` whose ``add`` and ``mul`` are wrong
(``a - b``, ``a + b``) while ``sub`` is right. The hidden tests (``test_patch``) add
``tests/test_calc.py``; ``tests/test_existing.py::test_sub`` is in the repository (PASS_TO_PASS).
A second commit after ``base_commit`` fixes ``add`` upstream: it must never reach the agent.

Every container is labelled ``conveyor.run_id=<RUN_ID>``; the session finalizer removes any left
and fails the run if there were some.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from docker_support import leak_checked_docker_client

from services.rollout_worker.environments.coding import CodingEnv, coding_task
from services.rollout_worker.environments.coding.images import PYTHON_REPOSITORY, build_python_image

from coding_helpers import CALC, EXISTING_TEST, F2P, HIDDEN_TEST, P2P

RUN_ID = "codingtest-" + uuid.uuid4().hex[:8]
RUN_LABEL = f"conveyor.run_id={RUN_ID}"

@pytest.fixture(scope="session")
def docker_client():
    with leak_checked_docker_client(RUN_LABEL, "coding") as client:
        yield client


def _mirror_reachable() -> bool:
    try:
        socket.create_connection(("deb.debian.org", 80), timeout=3).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def python_image(docker_client) -> str:
    """The Python profile's image: reused if present, else built once (debootstrap, ~1 min)."""
    present = {t for image in docker_client.images.list(PYTHON_REPOSITORY) for t in image.tags}
    try:
        if not present and (os.geteuid() != 0 or shutil.which("debootstrap") is None or not _mirror_reachable()):
            pytest.skip("the conveyor/python image is absent and cannot be built here "
                        "(needs root, debootstrap and deb.debian.org): run images/python/build.sh")
        started = time.monotonic()
        tag = build_python_image(docker_client)
        elapsed = time.monotonic() - started
        if tag not in present:
            print(f"\nbuilt {tag} in {elapsed:.1f} s")
        return tag
    except RuntimeError as exc:
        pytest.skip(f"cannot build the Python sandbox image: {exc}")


def _git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="session")
def fixture_repo(tmp_path_factory) -> dict:
    """{path, base_commit, fix_commit, test_patch}: a local repository served by path or file://."""
    repo = tmp_path_factory.mktemp("calc-repo")
    _git(repo, "init", "-q", "-b", "main")
    (repo / "calc").mkdir()
    (repo / "calc" / "__init__.py").write_text(CALC)
    (repo / "tests").mkdir()
    (repo / "tests" / "test_existing.py").write_text(EXISTING_TEST)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "calc with bugs")
    base = _git(repo, "rev-parse", "HEAD").strip()
    # the hidden tests, as a diff against base (made in a scratch clone; the repo never has them)
    scratch = tmp_path_factory.mktemp("scratch")
    _git(scratch, "clone", "-q", str(repo), "c")
    (scratch / "c" / "tests" / "test_calc.py").write_text(HIDDEN_TEST)
    _git(scratch / "c", "add", "-A")
    test_patch = _git(scratch / "c", "diff", "--cached", "HEAD")
    # upstream fixes add after base_commit
    (repo / "calc" / "__init__.py").write_text(CALC.replace("return a - b", "return a + b", 1))
    _git(repo, "commit", "-qam", "upstream fix of add")
    return {"path": str(repo), "base_commit": base, "fix_commit": _git(repo, "rev-parse", "HEAD").strip(),
            "test_patch": test_patch}


@pytest.fixture
def swe_bench_row(fixture_repo) -> dict:
    """A SWE-bench row for the fixture repo; FAIL_TO_PASS/PASS_TO_PASS as JSON strings, as in the dataset."""
    return {
        "instance_id": "calc__calc-1", "repo": "calc/calc", "repo_url": "file://" + fixture_repo["path"],
        "base_commit": fixture_repo["base_commit"],
        "problem_statement": "calc.add(2, 3) returns -1 and calc.mul(2, 3) returns 5. Fix them.",
        "test_patch": fixture_repo["test_patch"], "FAIL_TO_PASS": json.dumps(F2P), "PASS_TO_PASS": json.dumps(P2P),
    }


@pytest.fixture
def make_env(docker_client, python_image, tmp_path_factory, request):
    """``make_env(**env_config)``: a CodingEnv on the Python image, labelled for this test. After the
    test, every env is closed and the test's trajectories must have no container left."""
    cache = tmp_path_factory.getbasetemp() / "workspaces"
    made: list[CodingEnv] = []

    def make(**config) -> CodingEnv:
        env = CodingEnv({"image": python_image, "workspace_cache_dir": str(cache), "command_timeout_s": 20,
                         "test_timeout_s": 60, **config})
        trajectory = re.sub(r"[^A-Za-z0-9_.-]", "-", f"{RUN_ID}-{request.node.name}")[:180] + f"-{len(made)}"
        env.bind_trajectory(run_id=RUN_ID, group_id="g0", trajectory_id=trajectory)
        made.append(env)
        return env

    yield make
    for env in made:
        asyncio.run(env.close())
        left = docker_client.api.containers(all=True, filters={
            "label": [RUN_LABEL, f"conveyor.trajectory_id={env.labels.trajectory_id}"]})
        assert not left, f"{env.labels.trajectory_id} left containers behind: {[c['Names'] for c in left]}"


@pytest.fixture
def swe_task(swe_bench_row) -> dict:
    return coding_task(swe_bench_row)
