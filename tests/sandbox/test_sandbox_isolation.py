"""Isolation by default: what a sandbox cannot do, tried for real."""

from __future__ import annotations

import asyncio
import ipaddress
import re
import subprocess

import pytest

from services.rollout_worker.sandbox import Limits, NetworkPolicy, Sandbox, SandboxConfigError
from shared.stack_id import current_stack_id

pytestmark = [pytest.mark.docker, pytest.mark.timeout(180)]


def run(coro):
    return asyncio.run(coro)


def test_container_is_hardened_and_labelled(make_spec, docker_client, sandbox_run_id):
    spec = make_spec(limits=Limits(memory="128MiB", cpus=0.5, pids=100))

    async def scenario():
        async with await Sandbox.provision(spec) as sandbox:
            attrs = docker_client.api.inspect_container(sandbox.container_id)
            inside = await sandbox.exec("id -u; grep CapEff /proc/self/status; ls /var/run/docker.sock 2>&1; "
                                        "cat /proc/net/dev | tail -n +3 | cut -d: -f1")
            return attrs, inside.output

    attrs, inside = run(scenario())
    host = attrs["HostConfig"]
    assert host["NetworkMode"] == "none" and not host["Privileged"]
    # Only the session shell (PID 1, root) holds these; commands run as 65534 with none (CapEff below).
    assert host["CapDrop"] == ["ALL"] and sorted(host["CapAdd"]) == ["KILL", "SETGID", "SETUID"]
    assert host["SecurityOpt"][0] == "no-new-privileges" and host["SecurityOpt"][1].startswith("seccomp={")
    assert host["PidsLimit"] == 100
    assert host["Memory"] == host["MemorySwap"] == 128 << 20
    assert host["NanoCpus"] == 500_000_000
    assert host["ReadonlyRootfs"] is True
    assert not host.get("Binds") and not attrs["Mounts"]  # nothing from the host, so no docker socket
    labels = attrs["Config"]["Labels"]
    assert labels["conveyor.run_id"] == sandbox_run_id and labels["conveyor.group_id"] == "g0"
    assert labels["conveyor.trajectory_id"] == spec.labels.trajectory_id
    assert labels["conveyor.stack"] == current_stack_id()  # this checkout's: only its janitor removes it
    assert float(labels["conveyor.ttl"]) > 0 and float(labels["conveyor.created_at"]) > 0
    lines = inside.split("\n")
    assert lines[0] == "65534"
    assert lines[1].split() == ["CapEff:", "0000000000000000"]
    assert "No such file" in lines[2]
    assert [line.strip() for line in lines[3:] if line.strip()] == ["lo"]  # loopback only


def test_writes_outside_the_workspace_fail(make_spec):
    async def scenario():
        async with await Sandbox.provision(make_spec(limits=Limits(workspace_size="8MiB"))) as sandbox:
            for path in ("/etc/evil", "/bin/evil", "/evil", "/root/evil"):
                result = await sandbox.exec(f"echo x > {path}")
                assert result.exit_code != 0, path
                assert "Read-only file system" in result.output or "Permission denied" in result.output, result.output
            assert (await sandbox.exec("echo ok > /workspace/f && echo ok > /tmp/f")).ok
            full = await sandbox.exec("head -c 16m /dev/zero > /workspace/big")
            assert full.exit_code != 0  # busybox says "I/O error" for ENOSPC
            assert int((await sandbox.exec("wc -c < /workspace/big")).output) <= 8 << 20
    run(scenario())


def _host_addresses(docker_client) -> list[str]:
    ipam = docker_client.networks.get("bridge").attrs["IPAM"]["Config"][0]
    gateway = ipam.get("Gateway") or str(next(ipaddress.ip_network(ipam["Subnet"]).hosts()))
    own = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    return [gateway, "127.0.0.1", *[ip for ip in own if ":" not in ip and ip != gateway]]


def test_network_is_blocked_even_to_a_redis_on_the_host(make_spec, docker_client, host_redis, busybox_image,
                                                        sandbox_run_id):
    targets = _host_addresses(docker_client)
    probe = "printf 'PING\\r\\n' | nc -w 2 {ip} {port}; echo \" rc=$?\""

    # Control: a container on the default bridge does reach the host's Redis, so the probe works.
    control = docker_client.containers.run(
        busybox_image, ["sh", "-c", probe.format(ip=targets[0], port=host_redis)], detach=True,
        labels={"conveyor.run_id": sandbox_run_id, "conveyor.trajectory_id": f"{sandbox_run_id}_control"})
    try:
        control.wait(timeout=30)
        assert "+PONG" in control.logs().decode(), control.logs()
    finally:
        control.remove(force=True)

    async def scenario():
        async with await Sandbox.provision(make_spec()) as sandbox:
            for ip in targets:
                result = await sandbox.exec(probe.format(ip=ip, port=host_redis), timeout_s=10)
                assert "+PONG" not in result.output and "rc=0" not in result.output, (ip, result.output)
                web = await sandbox.exec(f"wget -T 2 -q -O - http://{ip}:{host_redis}/; echo rc=$?", timeout_s=10)
                assert "rc=0" not in web.output, (ip, web.output)
            dns = await sandbox.exec("nslookup example.com 2>&1; echo rc=$?", timeout_s=15)
            assert "rc=0" not in dns.output
    run(scenario())


def test_fork_bomb_is_contained_by_the_pids_limit(make_spec, containers_of):
    spec = make_spec(limits=Limits(pids=64))
    bound = 5 + spec.timeouts.kill_grace_s + 2

    async def scenario():
        async with await Sandbox.provision(spec) as sandbox:
            for bomb in ("f(){ f|f; }; f", "f(){ f|f& }; f"):  # in the foreground, then left running
                result = await sandbox.exec(bomb, timeout_s=5)
                assert result.duration_s < bound
            # The sandbox answers again: its shell survives failed forks (see protocol.PREAMBLE),
            # though the bombs' last "can't fork" messages may land in a command or two.
            for _ in range(20):
                result = await sandbox.exec("echo \"alive procs=$(ls /proc | grep -c '^[0-9]')\"", timeout_s=5)
                found = re.search(r"^alive procs=(\d+)$", result.output, re.MULTILINE)
                if result.ok and found and int(found.group(1)) < 10:
                    return
                await asyncio.sleep(0.25)
            raise AssertionError(f"the sandbox did not recover: {result}")

    run(scenario())  # and this process, the worker, carries on
    assert not containers_of(spec.labels.trajectory_id)


def test_memory_hog_is_killed_and_the_worker_is_unharmed(make_spec):
    async def scenario():
        async with await Sandbox.provision(make_spec(limits=Limits(memory="64MiB"))) as sandbox:
            hog = await sandbox.exec("head -c 400m /dev/zero | tail; echo rc=$?", timeout_s=60)
            assert "rc=137" in hog.output, hog.output  # the OOM killer's SIGKILL
            assert (await sandbox.exec("echo alive")).output == "alive\n"
    run(scenario())


def test_unenforceable_specs_are_refused_before_any_container_exists(make_spec, docker_client, containers_of):
    allowlist = make_spec(network=NetworkPolicy(mode="allowlist", allow=("pypi.org:443",)))
    with pytest.raises(SandboxConfigError, match="allowlist"):
        run(Sandbox.provision(allowlist))
    info = docker_client.info()
    backing = dict(map(tuple, info.get("DriverStatus") or [])).get("Backing Filesystem")
    if info.get("Driver") == "overlay2" and backing == "xfs":
        pytest.skip("this daemon supports disk quotas")
    quota = make_spec(limits=Limits(disk="1GiB"))
    with pytest.raises(SandboxConfigError, match="limits.disk"):
        run(Sandbox.provision(quota))
    assert not containers_of(allowlist.labels.trajectory_id)
    assert not containers_of(quota.labels.trajectory_id)
