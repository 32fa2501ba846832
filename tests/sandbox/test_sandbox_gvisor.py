"""Sandboxes under gVisor (``runtime: runsc`` on a ``docker`` provider): the namespaced second
dockerd of ``remote_docker_support`` has runsc registered (the host daemon is left as it is), and
the same isolation policy holds there as under runc. Skipped where runsc is not installed.

The sandbox here runs the persistent session shell: gVisor will not execute the worker's
unreadable shell, so the session opens without a worker and drops privileges per command
(``protocol.open_lines``); status and working directory still carry over."""

from __future__ import annotations

import asyncio
import os

import pytest
from remote_docker_support import remote_docker_host

from services.rollout_worker.sandbox import Sandbox
from services.rollout_worker.sandbox import providers
from services.rollout_worker.sandbox.images import ship_image

pytestmark = [pytest.mark.docker, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def gvisor(docker_client, busybox_image, sandbox_run_id):
    """The provider of a namespaced daemon that runs sandboxes under runsc, holding the busybox image."""
    with remote_docker_host(runtime="runsc") as host:
        provider = providers.provider_from(host.settings)
        ship_image(busybox_image, source=docker_client, target=provider.client)
        yield provider
        assert not provider.list_sandboxes([f"conveyor.run_id={sandbox_run_id}"]), "sandboxes left under runsc"


def test_a_sandbox_under_runsc_runs_on_gvisors_kernel_with_the_same_isolation(gvisor, make_spec):
    spec = make_spec()
    probes = {
        "kernel": "uname -r",
        "uid": "id -u",
        "interfaces": "grep -c : /proc/net/dev",
        "root": "touch /x 2>&1 || echo read-only",
        "docker socket": "ls /var/run/docker.sock 2>&1 || echo none",
        "become root": "su -c id root 2>&1 || echo refused",
    }

    async def episode() -> tuple[dict[str, str], dict]:
        async with await Sandbox.provision(spec, provider=gvisor) as sandbox:
            seen = {name: (await sandbox.exec(command)).output.strip() for name, command in probes.items()}
            failed = await sandbox.exec("cd /tmp; echo $$ > /tmp/pid; sh -c 'exit 7'")
            seen["status, cwd"] = f"{failed.exit_code} {(await sandbox.exec('pwd')).output.strip()}"
            seen["fresh process"] = str((await sandbox.exec("[ $$ != $(cat /tmp/pid) ] && echo yes")).output.strip())
            config = await asyncio.to_thread(gvisor.client.api.inspect_container, sandbox.container_id)
        return seen, config["HostConfig"]

    seen, host_config = asyncio.run(episode())
    assert host_config["Runtime"] == "runsc"
    assert seen["kernel"] != os.uname().release  # gVisor's Sentry answers, not the host kernel
    assert seen["uid"] == "65534"
    assert seen["interfaces"] == "1"  # loopback only
    assert seen["root"].endswith("read-only")
    assert seen["docker socket"].endswith("none")
    assert seen["become root"].endswith("refused")
    assert seen["status, cwd"] == "7 /tmp"
    assert seen["fresh process"] == "yes"  # no worker under runsc: each command is a new process
    assert host_config["PidsLimit"] == spec.limits.pids and host_config["Memory"] == int(spec.limits.memory)

