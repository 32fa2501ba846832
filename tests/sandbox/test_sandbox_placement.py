"""Placement over two real Docker hosts: the local daemon and a second one in a network namespace
(``remote_docker_support``), as ``sandbox.provider: {kind: docker_hosts, hosts: [...]}`` names
them (``placement.HostPlacement``). The namespaced daemon starts without the test image; the
module's last test kills it."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from remote_docker_support import remote_docker_host

from services.rollout_worker.sandbox import Sandbox, SandboxInfraError, provision_with_retry, reap
from services.rollout_worker.sandbox import providers
from services.rollout_worker.sandbox.docker_provider import HEALTH_TIMEOUT_S
from services.rollout_worker.sandbox.images import image_exists, ship_image
from services.rollout_worker.sandbox.placement import HostPlacement
from shared.settings import SettingsError, load_settings
from shared.settings.sandbox import DockerHostsSettings, DockerProviderSettings, SandboxSettings

pytestmark = [pytest.mark.docker, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def remote(docker_client, busybox_image):
    """The namespaced host, holding no image yet; killed by the last test."""
    with remote_docker_host() as host:
        yield host


def test_hosts_settings_round_trip_through_the_union():
    settings = load_settings(sandbox={"provider": {"kind": "docker_hosts", "hosts": [{}],
                                                   "max_sandboxes_per_host": 4}}).sandbox.provider
    assert isinstance(settings, DockerHostsSettings) and settings.max_sandboxes_per_host == 4


def two_hosts(remote, room: int = 32, *, image: str | None = None, recheck_s: float = 60) -> HostPlacement:
    """A fresh placement (its own counts) over the local daemon, then the namespaced one (given
    ``image`` first, when named)."""
    local = providers.docker_provider(DockerProviderSettings())
    if image is not None:
        ship_image(image, source=local.client, target=providers.docker_provider(remote.settings).client)
    return HostPlacement([local, providers.docker_provider(remote.settings)], max_sandboxes_per_host=room,
                         recheck_s=recheck_s)


def wait_until(condition, timeout_s: float = 15) -> float:
    """Seconds until ``condition()`` holds (polled, as placements would ask)."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, "the condition never held"
        time.sleep(0.02)
    return time.monotonic() - start


async def _burst_hosts(placement: HostPlacement, make_spec, count: int) -> list[str]:
    """The host ("local" or "far") of each of ``count`` sandboxes provisioned at once."""
    local, _far = placement.hosts
    sandboxes = await asyncio.gather(*(Sandbox.provision(make_spec(), provider=placement) for _ in range(count)))
    try:
        return ["local" if s.provider is local else "far" for s in sandboxes]
    finally:
        await _teardown(list(sandboxes))


def test_docker_hosts_settings_make_one_placement_whose_hosts_the_janitor_sweeps(remote):
    local = DockerProviderSettings()
    settings = SandboxSettings.model_validate({"environments": {"coding": {"kind": "docker_hosts", "hosts": [
        local.model_dump(), remote.settings.model_dump(mode="json")]}}})
    before = providers._settings
    providers.configure(settings)
    try:
        placement = providers.provider_for_environment("coding")
        assert isinstance(placement, HostPlacement)
        assert [h.provider for h in placement.hosts] == [providers.docker_provider(local),
                                                         providers.docker_provider(remote.settings)]
        assert providers.configured() == [h.provider for h in placement.hosts]  # the local one once
    finally:
        providers.configure(before)
    with pytest.raises(SettingsError, match="a sandbox host is listed twice: the local daemon"):
        load_settings(sandbox={"provider": {"kind": "docker_hosts", "hosts": [{}, {"kind": "docker"}]}})
    with pytest.raises(SettingsError, match="hosts: List should have at least 1 item"):
        load_settings(sandbox={"provider": {"kind": "docker_hosts", "hosts": []}})


def test_a_host_without_the_image_is_used_only_when_the_hosts_with_it_are_full(remote, make_spec, docker_client,
                                                                               busybox_image):
    placement = two_hosts(remote, room=2)
    local, far = placement.hosts
    image_id = docker_client.images.get(busybox_image).id
    assert not image_exists(far.provider.client, image_id)

    async def one_by_one() -> list[Sandbox]:
        sandboxes: list[Sandbox] = []
        try:
            for _ in range(4):
                sandboxes.append(await Sandbox.provision(make_spec(), provider=placement))
            return sandboxes[:]
        finally:
            loads.append((local.load, far.load))
            await _teardown(sandboxes)

    loads: list[tuple[int, int]] = []
    sandboxes = asyncio.run(one_by_one())
    # two on the host with the image (up to its room), though the other was emptier; then the
    # image is shipped (by content: the same id there) and the emptier host takes the next two
    assert [s.provider for s in sandboxes] == [local, local, far, far]
    assert far.provider.client.images.get(busybox_image).id == image_id
    assert loads == [(2, 2)]
    assert (local.load, far.load) == (0, 0)


def test_a_host_whose_image_was_removed_since_is_looked_at_again(remote, make_spec, docker_client, busybox_image):
    local, far = providers.docker_provider(DockerProviderSettings()), providers.docker_provider(remote.settings)
    ship_image(busybox_image, source=local.client, target=far.client)
    placement = HostPlacement([far, local], max_sandboxes_per_host=4, recheck_s=60)  # the namespaced one first
    image_id = docker_client.images.get(busybox_image).id

    async def twice() -> tuple[Sandbox, Sandbox]:
        async with await Sandbox.provision(make_spec(), provider=placement) as first:
            pass
        far.client.images.remove(image_id, force=True)  # pruned there since
        second = await provision_with_retry(make_spec(), provider=placement, backoff_initial_s=0.05)
        await second.teardown()
        return first, second

    first, second = asyncio.run(twice())
    assert first.provider is placement.hosts[0]  # it held the image, and ties go to the first listed
    assert second.provider is placement.hosts[1] and placement.hosts[0].images == set()


def test_the_janitor_reaps_orphans_on_every_host_of_a_placement(remote, make_spec, busybox_image, sandbox_run_id):
    settings = DockerHostsSettings(hosts=[DockerProviderSettings(), remote.settings], max_sandboxes_per_host=1)
    two_hosts(remote, image=busybox_image)  # ships the image there
    before = providers._settings
    providers.configure(SandboxSettings(provider=settings))
    try:
        placement = providers.default_provider()
        assert isinstance(placement, HostPlacement)

        async def orphans_then_sweep() -> tuple[list[int], list[str]]:
            sandboxes = [await Sandbox.provision(make_spec(), provider=placement) for _ in range(2)]
            try:  # their worker is gone: the janitor's sweep of every configured provider
                swept = [await asyncio.to_thread(reap, provider, stack_id=sandboxes[0].spec.labels.stack_id,
                                                 run_id=sandbox_run_id, now=float("inf"))
                         for provider in providers.configured()]
                return [len(reaped) for reaped in swept], [s.container_id for s in sandboxes]
            finally:
                await _teardown(sandboxes)

        counts, made = asyncio.run(orphans_then_sweep())
    finally:
        providers.configure(before)
    assert counts == [1, 1]  # one on each host (the second to the less loaded), each removed by its sweep
    assert all(h.list_sandboxes([f"conveyor.run_id={sandbox_run_id}"]) == [] for h in placement.hosts)
    assert len(set(made)) == 2


def test_a_burst_spreads_evenly_over_the_two_hosts(remote, make_spec, sandbox_run_id, busybox_image):
    placement = two_hosts(remote, image=busybox_image)
    local, far = placement.hosts

    async def burst() -> tuple[list[Sandbox], list[str], list[str]]:
        sandboxes = await asyncio.gather(*(Sandbox.provision(make_spec(), provider=placement) for _ in range(12)))
        try:
            outputs = await asyncio.gather(*(s.exec("echo up") for s in sandboxes))
            on_far = await asyncio.to_thread(far.list_sandboxes, [f"conveyor.run_id={sandbox_run_id}"])
            return sandboxes, [o.output for o in outputs], [s.id for s in on_far]
        finally:
            await _teardown(sandboxes)

    sandboxes, outputs, on_far = asyncio.run(burst())
    assert outputs == ["up\n"] * 12
    assert (local.placed, far.placed) == (6, 6) and (local.peak_load, far.peak_load) == (6, 6)
    assert sorted(on_far) == sorted(s.container_id for s in sandboxes if s.provider is far)
    assert (local.load, far.load) == (0, 0)


def test_a_lost_host_gets_no_sandbox_until_a_background_ping_finds_it_answering(make_spec):
    placement = HostPlacement([providers.docker_provider(DockerProviderSettings())], max_sandboxes_per_host=4,
                              recheck_s=0.2)
    host = placement.hosts[0]
    host.lost_at = time.monotonic()  # as a call that failed as daemon_unreachable marks it
    with pytest.raises(SandboxInfraError, match="no sandbox host answers") as raised:
        asyncio.run(placement.place(make_spec()))
    assert raised.value.reason == "daemon_unreachable" and host.load == 0
    deadline = time.monotonic() + 10
    while not host.usable(time.monotonic()):  # skipped for recheck_s, then pinged in the background
        assert time.monotonic() < deadline, "the lost host was never pinged again"
        time.sleep(0.02)
    assert host.lost_at is None

    async def provision() -> str:
        async with await Sandbox.provision(make_spec(), provider=placement) as sandbox:
            assert sandbox.provider is host
            return (await sandbox.exec("echo back")).output

    assert asyncio.run(provision()) == "back\n" and host.load == 0


def test_a_host_that_stays_silent_is_skipped_until_it_answers_again(remote, make_spec, busybox_image):
    """The namespaced daemon stopped (SIGSTOP): connections to it hang. The background ping of a
    host in use finds it silent (``HEALTH_TIMEOUT_S``), and placement stops choosing it; once it
    answers again (SIGCONT), the next ping puts it back."""
    placement = two_hosts(remote, image=busybox_image, recheck_s=0.3)
    _local, far = placement.hosts
    assert sorted(asyncio.run(_burst_hosts(placement, make_spec, 2))) == ["far", "local"]
    remote.silence()
    try:
        silent_for = wait_until(lambda: not far.usable(time.monotonic()))
        assert asyncio.run(_burst_hosts(placement, make_spec, 3)) == ["local"] * 3
    finally:
        remote.answer()
    back_after = wait_until(lambda: far.usable(time.monotonic()))
    assert sorted(asyncio.run(_burst_hosts(placement, make_spec, 2))) == ["far", "local"]
    assert silent_for < 0.3 + HEALTH_TIMEOUT_S + 1 and back_after < 0.3 + 1, (silent_for, back_after)


def test_episodes_on_a_host_lost_mid_burst_are_retried_and_finish_on_the_other(remote, make_spec, busybox_image):
    """Last in the module: it kills the namespaced daemon mid-burst, then starts it again, and
    placement uses it again once its ping answers."""
    placement = two_hosts(remote, image=busybox_image, recheck_s=0.3)
    local, far = placement.hosts
    killed = asyncio.Event()
    runs: list[tuple[str, str]] = []  # (episode, host) of each provisioned sandbox

    async def episode(index: int) -> str:
        for _ in range(3):  # a trajectory failed as an infra error is run again (the runner requeues it)
            sandbox = await provision_with_retry(make_spec(), provider=placement, backoff_initial_s=0.05)
            runs.append((f"e{index}", "far" if sandbox.provider is far else "local"))
            try:
                await sandbox.exec("echo started")
                await killed.wait()
                return (await sandbox.exec("echo finished")).output
            except SandboxInfraError as lost:
                assert lost.reason == "daemon_unreachable"
            finally:
                with contextlib.suppress(SandboxInfraError):
                    await sandbox.teardown()
        raise AssertionError(f"episode {index} never finished")

    async def kill_when_the_far_host_has_sandboxes() -> None:
        while len([name for name, host in runs if host == "far"]) < 2:  # others may be being created there
            await asyncio.sleep(0.005)
        await asyncio.to_thread(remote.lose)
        killed.set()

    async def burst() -> list[str]:
        killer = asyncio.create_task(kill_when_the_far_host_has_sandboxes())
        outputs = await asyncio.gather(*(episode(i) for i in range(12)))
        await killer
        return outputs

    outputs = asyncio.run(burst())
    assert outputs == ["finished\n"] * 12
    assert far.placed == 6 and far.lost_at is not None  # half the burst went there, before the loss
    rerun = {name for name, host in runs if host == "far"}
    assert len(rerun) >= 2 and all((name, "local") in runs for name in rerun)  # each finished on the local host
    assert local.load == 0
    assert not far.usable(time.monotonic())  # pinged every recheck_s since: still refused
    remote.come_back()
    wait_until(lambda: far.usable(time.monotonic()))
    assert sorted(asyncio.run(_burst_hosts(placement, make_spec, 2))) == ["far", "local"]


async def _teardown(sandboxes: list[Sandbox]) -> None:
    await asyncio.gather(*(s.teardown() for s in sandboxes))
