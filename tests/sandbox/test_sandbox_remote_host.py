"""Sandboxes on another host's Docker daemon, over TCP with mutual TLS: a second dockerd in a
network namespace of its own (``remote_docker_support``), driven through the ``docker`` provider
that ``sandbox.provider: {kind: docker, host: tcp://..., tls: ...}`` names."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time

import docker
import pytest
import requests.exceptions
from docker.tls import TLSConfig
from remote_docker_support import remote_docker_host

from services.rollout_worker.sandbox import Sandbox, SandboxInfraError, reap
from services.rollout_worker.sandbox.docker_provider import DockerProvider
from services.rollout_worker.sandbox import providers
from services.rollout_worker.sandbox.images import ship_image
from shared.settings.sandbox import DockerProviderSettings, SandboxSettings

pytestmark = [pytest.mark.docker, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def remote(docker_client, busybox_image, sandbox_run_id):
    """(settings, provider) of the namespaced daemon, holding the busybox image; no container of
    this session may be left on it."""
    with remote_docker_host() as host:
        settings = host.settings
        provider = providers.provider_from(settings)
        image_id = ship_image(busybox_image, source=docker_client, target=provider.client)
        assert provider.client.images.get(busybox_image).id == image_id
        yield settings, provider
        leftovers = provider.list_sandboxes([f"conveyor.run_id={sandbox_run_id}"])
        assert not leftovers, f"sandboxes left on the remote host: {leftovers}"


def _archive(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buf.getvalue()


async def _first_command_s(spec, provider) -> tuple[float, Sandbox]:
    start = time.perf_counter()
    sandbox = await Sandbox.provision(spec, provider=provider)
    await sandbox.exec("true")
    return time.perf_counter() - start, sandbox


def test_a_sandbox_episode_runs_on_the_remote_host_isolated_as_on_the_local_one(remote, make_spec, containers_of,
                                                                                 docker_client, busybox_image):
    settings, provider = remote
    spec = make_spec()

    async def episode():
        cold_s, sandbox = await _first_command_s(spec, provider)
        await sandbox.teardown()
        sandbox = await Sandbox.provision(spec, provider=provider, workspace=_archive({"seed.txt": b"from the worker\n"}))
        async with sandbox:
            await sandbox.write_file("notes.txt", "remote\n")
            checks = await sandbox.exec("cat seed.txt notes.txt; id -u; grep -c : /proc/net/dev; touch /x 2>&1 || echo ro; "
                                        "ls /var/run/docker.sock 2>&1 || echo nosock")
            diff = await sandbox.diff()
            on_local = containers_of(spec.labels.trajectory_id)
            on_remote = await asyncio.to_thread(provider.list_sandboxes,
                                                [f"conveyor.trajectory_id={spec.labels.trajectory_id}"])
            round_trips = []
            for _ in range(5):
                round_trips.append((await sandbox.exec("true")).duration_s)
        return cold_s, checks.output.splitlines(), diff, on_local, on_remote, sorted(round_trips)[2]

    cold_s, lines, diff, on_local, on_remote, round_trip_s = asyncio.run(episode())
    assert lines[0:3] == ["from the worker", "remote", "65534"]  # the workspace was copied in
    lines = lines[1:]
    assert lines[2] == "1"  # one interface, loopback: no network
    assert lines[3].endswith("ro") or "Read-only" in lines[3]
    assert lines[-1] == "nosock"
    assert round_trip_s < 0.03  # the persistent shell over TLS, not one exec per command (about 60 ms)
    assert diff.added == ("notes.txt",)
    assert on_local == [] and len(on_remote) == 1
    assert provider.list_sandboxes([f"conveyor.trajectory_id={spec.labels.trajectory_id}"]) == []  # torn down there

    async def local_cold_start() -> float:
        local_s, local_box = await _first_command_s(make_spec(), providers.provider_from(DockerProviderSettings()))
        await local_box.teardown()
        return local_s

    local_s = asyncio.run(local_cold_start())
    print(f"\ncreate + first command: local {local_s * 1000:.0f} ms, remote {cold_s * 1000:.0f} ms; "
          f"remote round trip {round_trip_s * 1000:.1f} ms (the shell over TLS)")


def test_the_remote_daemon_answers_only_a_client_with_the_workers_certificate(remote):
    settings, provider = remote
    provider.health()
    host = settings.host.replace("tcp://", "https://")
    anonymous = docker.APIClient(base_url=host, version="1.41", tls=TLSConfig(ca_cert=str(settings.tls.ca_cert),
                                                                              verify=True))
    anonymous.trust_env = False
    with pytest.raises(requests.exceptions.SSLError, match="bad certificate"):
        anonymous.ping()
    with pytest.raises((docker.errors.DockerException, requests.exceptions.RequestException)):
        docker.APIClient(base_url=settings.host.replace("tcp://", "http://"), version="1.41").ping()


def test_the_janitor_removes_the_sandbox_of_a_worker_killed_with_kill_9_on_the_remote_host(remote, make_spec):
    settings, provider = remote
    spec = make_spec()
    worker = textwrap.dedent(f"""
        import asyncio, sys, time
        from services.rollout_worker.sandbox import Sandbox, SandboxSpec
        from services.rollout_worker.sandbox.providers import provider_from
        from shared.settings.sandbox import DockerProviderSettings
        provider = provider_from(DockerProviderSettings.model_validate_json({settings.model_dump_json()!r}))
        spec = SandboxSpec.model_validate_json({spec.model_dump_json()!r})
        sandbox = asyncio.run(Sandbox.provision(spec, provider=provider))
        print(sandbox.container_id, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", worker], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        container_id = proc.stdout.readline().strip()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert container_id, "the worker did not provision its sandbox"
    label = [f"conveyor.trajectory_id={spec.labels.trajectory_id}"]
    assert [s.id for s in provider.list_sandboxes(label)] == [container_id]  # orphaned, still running
    providers.configure(SandboxSettings(environments={"coding": settings}))
    try:
        assert provider in providers.configured()  # the worker janitor sweeps it (worker_janitor)
    finally:
        providers.configure(SandboxSettings())
    reaped = reap(provider, stack_id=spec.labels.stack_id, run_id=spec.labels.run_id,
                  is_terminal=lambda trajectory_id: trajectory_id == spec.labels.trajectory_id)
    assert [(r.container_id, r.why) for r in reaped] == [(container_id, "terminal")]
    assert provider.list_sandboxes(label) == []


def test_a_host_lost_mid_episode_fails_its_commands_as_infra_errors(make_spec, docker_client, busybox_image):
    with remote_docker_host() as host:
        provider = DockerProvider(providers.docker_client(host.settings))  # not the shared one: it dies here
        ship_image(busybox_image, source=docker_client, target=provider.client)

        async def episode():
            sandbox = await Sandbox.provision(make_spec(), provider=provider)
            assert (await sandbox.exec("echo up")).output == "up\n"
            host.lose()
            with pytest.raises(SandboxInfraError) as raised:
                await sandbox.exec("echo still there?")
            with pytest.raises(SandboxInfraError):
                await sandbox.teardown()
            return raised.value

        lost = asyncio.run(episode())
    assert lost.reason == "daemon_unreachable"


def test_each_host_has_its_own_rate_limit_on_creation(remote, make_spec):
    settings, _ = remote
    remote_one_at_a_time = providers.provider_from(settings.model_copy(update={"max_concurrent_creates": 1}))
    local_two = providers.provider_from(DockerProviderSettings(host="unix:///var/run/docker.sock",
                                                               max_concurrent_creates=2))
    assert remote_one_at_a_time.limiter is not local_two.limiter

    async def burst():
        sandboxes = await asyncio.gather(*(Sandbox.provision(make_spec(), provider=p)
                                           for p in [remote_one_at_a_time] * 4 + [local_two] * 4))
        await asyncio.gather(*(s.teardown() for s in sandboxes))

    asyncio.run(burst())
    assert remote_one_at_a_time.limiter.peak_in_flight == 1
    assert local_two.limiter.peak_in_flight == 2  # four creates at once, two at a time
