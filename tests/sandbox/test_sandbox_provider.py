"""Sandbox providers: the settings choose one per environment, and a sandbox's whole life (create,
session, files, the janitor's list-and-remove, health) goes through the provider it was made on."""

from __future__ import annotations

import asyncio
import io
import tarfile

import pytest

from services.rollout_worker.sandbox import Sandbox, SandboxConfigError, reap
from services.rollout_worker.sandbox import providers
from services.rollout_worker.sandbox.docker_provider import DockerProvider
from services.rollout_worker.sandbox.provider import SandboxProvider
from shared.settings import SettingsError, load_settings
from shared.settings.sandbox import SandboxSettings

pytestmark = [pytest.mark.docker, pytest.mark.timeout(120)]

SOCKET = "unix:///var/run/docker.sock"


@pytest.fixture
def configured_providers():
    """The process's provider settings, put back as they were after the test."""
    before = providers._settings
    yield providers.configure
    providers.configure(before)


def test_each_environment_gets_the_provider_its_settings_name_and_equal_settings_share_one(configured_providers):
    settings = load_settings(sandbox={"provider": "docker", "environments": {"coding": {"host": SOCKET}}}).sandbox
    configured_providers(settings)
    stack, coding = providers.provider_for_environment("qa"), providers.provider_for_environment("coding")
    assert isinstance(coding, SandboxProvider) and isinstance(coding, DockerProvider)
    assert coding.client.api.base_url == "http+docker://localhost"  # the named socket, not DOCKER_HOST's
    assert stack is providers.default_provider() and coding is providers.provider_for_environment("coding")
    assert coding is not stack
    assert providers.configured() == [stack, coding]  # the janitor sweeps each once
    configured_providers(SandboxSettings(environments={"coding": {"kind": "docker"}, "agent_coding": "docker"}))
    assert providers.configured() == [providers.default_provider()]


@pytest.mark.parametrize("provider, message", [
    ({"kind": "e2b"}, "sandbox.provider.kind: Input tag 'e2b'"),
    ({"host": "tcp://10.0.0.7:2376"}, "a tcp:// Docker host needs tls"),
    ({"tls": {"ca_cert": "ca.pem", "client_cert": "c.pem", "client_key": "k.pem"}}, "tls needs a host"),
    ({"kind": "docker", "image": "x"}, "sandbox.provider.docker.image: Extra inputs are not permitted"),
])
def test_a_provider_setting_that_cannot_work_is_refused_with_its_place(provider, message):
    with pytest.raises(SettingsError, match=message.replace("(", r"\(")):
        load_settings(sandbox={"provider": provider})


def test_a_sandbox_lives_and_is_reaped_through_the_provider_it_was_made_on(make_spec, configured_providers):
    configured_providers(SandboxSettings(environments={"coding": {"host": SOCKET}}))
    provider = providers.provider_for_environment("coding")
    provider.health()
    spec = make_spec()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as archive:
        info = tarfile.TarInfo("hello.txt")
        info.size = 6
        archive.addfile(info, io.BytesIO(b"hello\n"))

    trajectory_label = f"conveyor.trajectory_id={spec.labels.trajectory_id}"

    async def scenario():
        sandbox = await Sandbox.provision(spec, workspace=buf.getvalue(), provider=provider)
        assert sandbox.provider is provider
        assert (await sandbox.exec("cat hello.txt; id -u")).output == "hello\n65534\n"
        listed = await asyncio.to_thread(provider.list_sandboxes, [trajectory_label])
        assert [s.id for s in listed] == [sandbox.container_id]
        assert listed[0].labels["conveyor.stack"] == spec.labels.stack_id
        # the worker "died" with the sandbox running: the janitor, through the provider, removes it
        reaped = await asyncio.to_thread(reap, provider, stack_id=spec.labels.stack_id, run_id=spec.labels.run_id,
                                         now=float("inf"))
        assert sandbox.container_id in [r.container_id for r in reaped]
        assert await asyncio.to_thread(provider.list_sandboxes, [trajectory_label]) == []
        await sandbox.teardown()  # idempotent on a sandbox the janitor already removed

    asyncio.run(scenario())


def test_an_environment_on_the_none_provider_gets_a_config_error_and_the_janitor_sweeps_only_real_ones(
        make_spec, configured_providers, monkeypatch):
    monkeypatch.setenv("CONVEYOR_SANDBOX__ENVIRONMENTS", '{"qa": "none"}')
    monkeypatch.setenv("CONVEYOR_SANDBOX__PROVIDER__KIND", "docker")
    configured_providers(load_settings().sandbox)
    none = providers.provider_for_environment("qa")
    assert none.kind == "none" and providers.configured() == [providers.default_provider(), none]
    assert none.list_sandboxes(["conveyor.trajectory_id"]) == []
    with pytest.raises(SandboxConfigError, match="sandbox provider is 'none'") as raised:
        asyncio.run(Sandbox.provision(make_spec(), provider=none))
    assert raised.value.reason == "no_provider"
