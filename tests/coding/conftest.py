"""Fixtures for the coding environment tests: Docker, the Python image, a git fixture repository.

The fixture repository is a tiny package ``calc`` whose ``add`` and ``mul`` are wrong
(``a - b``, ``a + b``) while ``sub`` is right. The hidden tests (``test_patch``) add
``tests/test_calc.py``; ``tests/test_existing.py::test_sub`` is in the repository (PASS_TO_PASS).
A second commit after ``base_commit`` fixes ``add`` upstream: it must never reach the agent.

Every container is labelled ``conveyor.run_id=<RUN_ID>``; the session finalizer removes any left
and fails the run if there were some.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid

import pytest
from docker_support import coding_env_maker, leak_checked_docker_client
from git_support import git

from services.rollout_worker.environments.coding import coding_task
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


@pytest.fixture(scope="session")
def fixture_repo(tmp_path_factory) -> dict:
    """{path, base_commit, fix_commit, test_patch}: a local repository served by path or file://."""
    repo = tmp_path_factory.mktemp("calc-repo")
    git(repo, "init", "-q", "-b", "main")
    (repo / "calc").mkdir()
    (repo / "calc" / "__init__.py").write_text(CALC)
    (repo / "tests").mkdir()
    (repo / "tests" / "test_existing.py").write_text(EXISTING_TEST)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "calc with bugs")
    base = git(repo, "rev-parse", "HEAD").strip()
    # the hidden tests, as a diff against base (made in a scratch clone; the repo never has them)
    scratch = tmp_path_factory.mktemp("scratch")
    git(scratch, "clone", "-q", str(repo), "c")
    (scratch / "c" / "tests" / "test_calc.py").write_text(HIDDEN_TEST)
    git(scratch / "c", "add", "-A")
    test_patch = git(scratch / "c", "diff", "--cached", "HEAD")
    # upstream fixes add after base_commit
    (repo / "calc" / "__init__.py").write_text(CALC.replace("return a - b", "return a + b", 1))
    git(repo, "commit", "-qam", "upstream fix of add")
    return {"path": str(repo), "base_commit": base, "fix_commit": git(repo, "rev-parse", "HEAD").strip(),
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
    """``make_env(**env_config)``: a CodingEnv on the Python image, labelled for this test; closed
    after it, and no container of its trajectories may be left."""
    cache = str(tmp_path_factory.getbasetemp() / "workspaces")
    with coding_env_maker(docker_client, python_image, cache, RUN_ID, request.node.name) as make:
        yield make


@pytest.fixture
def swe_task(swe_bench_row) -> dict:
    return coding_task(swe_bench_row)


@pytest.fixture
def coding_run_id(docker_client) -> str:
    """The run id to label containers with: the session's leak check covers it."""
    return RUN_ID


@pytest.fixture(scope="session")
def cline_image(python_image, docker_client) -> str:
    """Cline from the npm registry, with its driver, on the Python image (built once, ~2 min; reused by its tag)."""
    from services.rollout_worker.agents.images import build_agent_image

    try:
        started = time.monotonic()
        tag = build_agent_image(docker_client, "cline", python_image)
        print(f"\n{tag} ready in {time.monotonic() - started:.1f} s")
        return tag
    except RuntimeError as exc:
        if "could not install" in str(exc) and ("ENOTFOUND" in str(exc) or "EAI_AGAIN" in str(exc)):
            pytest.skip(f"the npm registry is not reachable: {exc}")
        raise
