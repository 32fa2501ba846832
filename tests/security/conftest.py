"""Fixtures of the red-team suite: real Docker, the busybox and Python sandbox images, one
long-lived sandbox per module for the session attacks, and a small git repository whose hidden
test fails until a bug is fixed (the coding-grader attacks; see ``shop_task``).

Every container is labelled ``conveyor.run_id=<RUN_ID>``; the session finalizer fails the run
if one is left behind.

With ``SECURITY_SANDBOX_HOST=namespaced`` the whole suite runs against a second dockerd
reached over TCP with mutual TLS (``remote_docker_support``): it is the process's default sandbox
provider, ``docker_client`` is its client, and the images are built here and shipped by id.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from docker_support import coding_env_maker, leak_checked_docker_client
from git_support import diff_of, git, write_files

from services.rollout_worker.environments.coding import coding_task
from services.rollout_worker.environments.coding.images import build_python_image
from services.rollout_worker.sandbox.images import build_busybox_image, ship_image
from security_support import DISCOUNT_TEST, F2P, HIDDEN_TEST, P2P, RUN_ID, RUNTIME, SHOP, SharedSandbox, spec_for

RUN_LABEL = f"conveyor.run_id={RUN_ID}"


REMOTE = os.environ.get("SECURITY_SANDBOX_HOST") == "namespaced" or RUNTIME != "runc"


@pytest.fixture(scope="session")
def local_docker_client():
    with leak_checked_docker_client(RUN_LABEL, "security") as client:
        yield client


@pytest.fixture(scope="session")
def docker_client(local_docker_client):
    """The daemon the sandboxes run on: the local one, or the namespaced remote one."""
    if not REMOTE:
        yield local_docker_client
        return
    from remote_docker_support import remote_docker_host

    from services.rollout_worker.sandbox import providers
    from shared.settings.sandbox import SandboxSettings

    with remote_docker_host(runtime=RUNTIME) as host:
        remote = providers.provider_from(host.settings)
        providers.configure(SandboxSettings(provider=host.settings))
        try:
            yield remote.client
        finally:
            providers.configure(SandboxSettings())
        leftovers = remote.list_sandboxes([RUN_LABEL])
        assert not leftovers, f"sandboxes left on the remote host: {leftovers}"


def _on_sandbox_host(tag: str, local, docker_client) -> str:
    if docker_client is not local:
        ship_image(tag, source=local, target=docker_client)
    return tag


@pytest.fixture(scope="session")
def busybox_image(local_docker_client, docker_client) -> str:
    return _on_sandbox_host(build_busybox_image(local_docker_client), local_docker_client, docker_client)


@pytest.fixture(scope="session")
def python_image(local_docker_client, docker_client) -> str:
    try:
        tag = build_python_image(local_docker_client)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot build the Python sandbox image (run images/python/build.sh): {exc}")
    return _on_sandbox_host(tag, local_docker_client, docker_client)


@pytest.fixture(scope="module")
def busybox_sandbox(busybox_image):
    shared = SharedSandbox(spec_for(busybox_image, "busybox"))
    yield shared
    shared.close()


@pytest.fixture(scope="module")
def python_sandbox(python_image):
    shared = SharedSandbox(spec_for(python_image, "python"))
    yield shared
    shared.close()


@pytest.fixture(scope="session")
def shop_task(tmp_path_factory) -> dict:
    """Task data of the shop repository (SWE-bench shape), its hidden test as ``test_patch``."""
    repo = tmp_path_factory.mktemp("shop-repo")
    git(repo, "init", "-q", "-b", "main")
    write_files(repo, {"shop/__init__.py": SHOP, "tests/test_discount.py": DISCOUNT_TEST})
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "shop")
    test_patch = diff_of(repo, {"tests/test_total.py": HIDDEN_TEST})
    row = {"instance_id": "shop-1", "repo": "shop/shop", "repo_url": f"file://{repo}",
           "base_commit": git(repo, "rev-parse", "HEAD").strip(), "problem_statement": "total() is off by one.",
           "test_patch": test_patch, "FAIL_TO_PASS": json.dumps(F2P), "PASS_TO_PASS": json.dumps(P2P)}
    return coding_task(row)


@pytest.fixture
def make_env(docker_client, python_image, tmp_path_factory, request):
    """``make_env(**env_config)``: a CodingEnv on the Python image, labelled for this test; closed
    after it, and no container of its trajectories may be left."""
    cache = str(tmp_path_factory.getbasetemp() / "workspaces")
    with coding_env_maker(docker_client, python_image, cache, RUN_ID, request.node.name) as make:
        yield make