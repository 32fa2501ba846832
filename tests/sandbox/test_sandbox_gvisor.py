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

from services.rollout_worker.sandbox import Limits, Sandbox
from services.rollout_worker.sandbox import providers
from services.rollout_worker.sandbox.deployment import GVISOR_HOST_PIDS_PER_PROCESS
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
    assert host_config["Memory"] == int(spec.limits.memory)
    # the process limit is gVisor's own RLIMIT_NPROC; the host's pids cgroup is a backstop for the Sentry
    assert {"Name": "nproc", "Soft": spec.limits.pids, "Hard": spec.limits.pids} in host_config["Ulimits"]
    assert host_config["PidsLimit"] == spec.limits.pids * GVISOR_HOST_PIDS_PER_PROCESS


# A command that ignores the kill signals, keeps processes in the background and stops its own
# shell: the timeout's kill must reach them all, and the session must answer afterwards.
_TAMPER = ("trap '' USR1 TERM INT HUP; i=0; while [ $i -lt {n} ]; do (trap '' USR1 TERM; sleep 300) & i=$((i+1)); done; "
           "setsid sh -c \"trap '' USR1 TERM; sleep 300\" & kill -STOP $$; sleep 300")


def test_under_runsc_processes_that_stop_their_shell_or_pass_the_limit_keep_the_sandbox(gvisor, make_spec):
    """Under runsc the host's pids cgroup counts the Sentry's threads and ptrace stubs, about 10
    host pids per sandbox process, never given back while the sandbox lives; a clone the host
    refuses crashes the whole Sentry (exit status 2, no output). With ``limits.pids`` as the host
    limit, 20 background processes lost the sandbox. The limit is gVisor's RLIMIT_NPROC instead: a
    fork past it fails inside, as under runc, and the session survives."""
    async def episode() -> list[str]:
        seen = []
        async with await Sandbox.provision(make_spec(), provider=gvisor) as sandbox:
            for _ in range(2):
                stopped = await sandbox.exec(_TAMPER.format(n=30), timeout_s=1)
                seen.append(f"{stopped.timed_out} {stopped.exit_code}")
                seen.append((await sandbox.exec("ps -o comm | grep -c sleep")).output.strip())
        async with await Sandbox.provision(make_spec(limits=Limits(pids=32)), provider=gvisor) as sandbox:
            past = await sandbox.exec("(i=0; while [ $i -lt 50 ]; do sleep 300 & i=$((i+1)); done) 2>/tmp/e; "
                                      "grep -m1 -o \"can't fork\" /tmp/e", timeout_s=20)
            seen.append(past.output.strip())
            seen.append((await sandbox.exec("kill -9 -1; echo alive")).output.strip())
        return seen

    assert asyncio.run(episode()) == ["True None", "0", "True None", "0", "can't fork", "alive"]

