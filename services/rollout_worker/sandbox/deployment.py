"""A sandbox container's lifecycle on the daemon: create (isolated, labelled), attach, start, remove.

Invariants:
- Every container this module creates carries the ``conveyor.*`` labels (stack, run, group,
  trajectory, created_at, ttl), so it is removed by its owner in ``finally`` or, failing that, by
  its own stack's janitor (``conveyor.stack``: no other stack's janitor touches it).
- Isolation is not optional: no network, all capabilities dropped, no-new-privileges, the
  ``seccomp`` profile, bounded pids/memory (no swap)/CPU, read-only root with size-bounded tmpfs
  for the workspace and /tmp, no core dumps, no log file on the host. The one mount from the
  host is ``agent_socket_dir``, when set: read-only, a directory holding one trajectory's
  agent-proxy socket (never the docker socket, never a directory of several sessions).
- PID 1 (the session shell) runs as root with only CAP_SETUID/SETGID/KILL and a root-only
  ``protocol.CONTROL_DIR``; every command runs as the spec's non-root user (``command_user``).
- A failure or cancellation between create and return removes the container: inside the worker
  thread when the daemon fails, from a done-callback when the caller was cancelled meanwhile.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import socket
import time
from dataclasses import dataclass

import docker.errors
from docker import APIClient
from docker.types import LogConfig, Ulimit

from shared.stack_id import LABEL_STACK

from . import tls_attach
from .blocking import run_blocking, submit
from .errors import SandboxConfigError
from .limiter import ProvisionLimiter
from .protocol import AGENT_DIR, BIN_DIR, CONTROL_DIR, SESSION_CAPS, SESSION_COMMAND, SESSION_ENV, SESSION_USER, parse_user
from .seccomp import security_opt
from .spec import SandboxSpec

LABEL_RUN_ID = "conveyor.run_id"
LABEL_GROUP_ID = "conveyor.group_id"
LABEL_TRAJECTORY_ID = "conveyor.trajectory_id"
LABEL_CREATED_AT = "conveyor.created_at"
LABEL_TTL = "conveyor.ttl"


@dataclass(frozen=True)
class StartedContainer:
    id: str
    name: str
    # stdin/stdout of PID 1 (a socket, or asyncio streams over TLS: tls_attach), or None: use exec_runner
    shell_socket: socket.socket | tuple[asyncio.StreamReader, asyncio.StreamWriter] | None
    uid: int = 65534  # what commands run as
    gid: int = 65534


def labels_for(spec: SandboxSpec, *, now: float) -> dict[str, str]:
    return {
        LABEL_STACK: spec.labels.stack_id,
        LABEL_RUN_ID: spec.labels.run_id,
        LABEL_GROUP_ID: spec.labels.group_id,
        LABEL_TRAJECTORY_ID: spec.labels.trajectory_id,
        LABEL_CREATED_AT: f"{now:.3f}",
        LABEL_TTL: f"{spec.effective_ttl_s:.0f}",
    }


def container_name(spec: SandboxSpec) -> str:
    stem = re.sub(r"[^A-Za-z0-9_.-]", "-", spec.labels.trajectory_id)[:80]
    return f"conveyor-{stem}-{secrets.token_hex(3)}"


def _tmpfs_options(size: int, user: str | None, *, shared: bool) -> str:
    opts = f"rw,exec,nosuid,nodev,size={size}"
    uid_gid = (user or "").split(":")
    if not shared and len(uid_gid) == 2 and all(part.isdigit() for part in uid_gid):
        return f"{opts},uid={uid_gid[0]},gid={uid_gid[1]},mode=0755"
    return f"{opts},mode=1777"


# Under gVisor the container's host pids cgroup holds the Sentry's threads and its ptrace stubs (the
# stub process of each sandbox process, with a stub thread per Sentry thread that ran it): measured,
# 10 host pids per idle sandbox process and 20 per process of a fork bomb, never given back while the
# sandbox lives. A clone the host refuses crashes the whole Sentry (Go panic, exit status 2, no
# output), where runc only fails the agent's fork. So under runsc the sandbox's process limit is
# gVisor's own RLIMIT_NPROC (enforced by the Sentry per uid of that sandbox alone: its uids are its
# own), a fork past it fails with EAGAIN as under runc, and the host limit is a backstop sized for
# the Sentry. Under runc RLIMIT_NPROC would count every process of the host's uid 65534: not used.
GVISOR_HOST_PIDS_PER_PROCESS = 32


def is_gvisor(runtime: str) -> bool:
    return runtime.startswith("runsc")


def pid_limits(pids: int, runtime: str) -> tuple[int, list[Ulimit]]:
    """(the host pids cgroup limit, the rlimits) that keep the sandbox to ``pids`` processes."""
    if is_gvisor(runtime):
        return pids * GVISOR_HOST_PIDS_PER_PROCESS, [Ulimit(name="nproc", soft=pids, hard=pids)]
    return pids, []


def create_kwargs(api: APIClient, spec: SandboxSpec, *, name: str, now: float, runtime: str = "runc") -> dict:
    """Arguments for ``APIClient.create_container``: the whole isolation policy in one place
    (``runtime``: the daemon's OCI runtime, runc or runsc; the policy is the same under each, but
    for how the process limit is enforced: ``pid_limits``)."""
    limits = spec.limits
    host_pids, pid_rlimits = pid_limits(limits.pids, runtime)
    host_config = api.create_host_config(
        runtime=runtime,
        network_mode="none",
        cap_drop=["ALL"],
        cap_add=list(SESSION_CAPS),
        security_opt=["no-new-privileges", security_opt()],
        privileged=False,
        pids_limit=host_pids,
        mem_limit=int(limits.memory),
        memswap_limit=int(limits.memory),
        nano_cpus=int(limits.cpus * 1e9),
        read_only=True,
        tmpfs={
            spec.workspace_dir: _tmpfs_options(int(limits.workspace_size), spec.user, shared=False),
            "/tmp": _tmpfs_options(int(limits.tmp_size), spec.user, shared=True),
            CONTROL_DIR: "rw,noexec,nosuid,nodev,size=64m,uid=0,gid=0,mode=0711",
            BIN_DIR: "rw,exec,nosuid,nodev,size=16m,uid=0,gid=0,mode=0711",
        },
        ulimits=[Ulimit(name="core", soft=0, hard=0), *pid_rlimits],
        # Output is read from the attached socket; a log file would only grow with every flood.
        log_config=LogConfig(type=LogConfig.types.NONE),
        ipc_mode="private",
        storage_opt={"size": str(int(limits.disk))} if limits.disk is not None else None,
        binds={spec.agent_socket_dir: {"bind": AGENT_DIR, "mode": "ro"}} if spec.agent_socket_dir else None,
    )
    return dict(
        image=spec.image,
        command=SESSION_COMMAND,
        name=name,
        user=SESSION_USER,
        environment={"HOME": "/tmp", **SESSION_ENV, **spec.env},
        working_dir=spec.workspace_dir,
        labels=labels_for(spec, now=now),
        stdin_open=True,
        tty=False,
        network_disabled=True,
        host_config=host_config,
    )


def command_user(api: APIClient, spec: SandboxSpec) -> tuple[int, int]:
    """The numeric uid/gid commands run as: the spec's, else the image's USER. Never root. Blocking."""
    user = spec.user if spec.user is not None else api.inspect_image(spec.image)["Config"].get("User") or "0"
    try:
        return parse_user(user)
    except ValueError as exc:
        raise SandboxConfigError(str(exc), reason="bad_user") from None


def check_supported(api: APIClient, spec: SandboxSpec) -> None:
    """Refuse, with a clear message, what this daemon or this code cannot enforce. Blocking."""
    if spec.network.mode != "none":
        raise SandboxConfigError(
            "network.mode='allowlist' is not implemented yet (it needs an egress proxy on an internal "
            "network); use 'none'", reason="unsupported_network")
    if spec.limits.disk is not None:
        info = api.info()
        backing = dict(map(tuple, info.get("DriverStatus") or [])).get("Backing Filesystem", "?")
        if info.get("Driver") != "overlay2" or backing != "xfs":
            raise SandboxConfigError(
                f"limits.disk needs overlay2 on xfs with pquota; this daemon runs {info.get('Driver')} on "
                f"{backing}. Writable space is already bounded by limits.workspace_size and limits.tmp_size "
                "(the root filesystem is read-only); leave limits.disk unset", reason="unsupported_disk_quota")


def remove_container(api: APIClient, container_id: str) -> None:
    """Force-remove with volumes; a container already gone (or going) is fine. Blocking."""
    try:
        api.remove_container(container_id, force=True, v=True)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as exc:
        if exc.status_code != 409:  # 409: removal already in progress
            raise


def tls_transport(api: APIClient) -> bool:
    """Whether the daemon is reached over TLS: the SDK's attached socket would be an SSLSocket,
    which asyncio cannot adopt, so ``tls_attach`` attaches instead (never the SDK: an attach
    closed again can close PID 1's stdin, and the sandbox with it)."""
    return str(api.base_url).startswith("https://")


def _raw_socket(attached) -> socket.socket | None:
    sock = getattr(attached, "_sock", attached)
    # Only a plain socket can be handed to asyncio; an SSLSocket cannot (TLS daemons: tls_attach).
    return sock if type(sock) is socket.socket else None


def _create_attach_start(api: APIClient, kwargs: dict, attach: bool, *, start: bool = True) -> tuple[str, socket.socket | None]:
    container_id = api.create_container(**kwargs)["Id"]
    sock = None
    try:
        if attach:
            attached = api.attach_socket(container_id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
            sock = _raw_socket(attached)
            if sock is None:
                attached.close()
        if start:
            api.start(container_id)
        return container_id, sock
    except BaseException:
        if sock is not None:
            sock.close()
        remove_container(api, container_id)
        raise


def _discard_when_created(api: APIClient):
    def callback(job) -> None:
        if job.cancelled() or job.exception() is not None:
            return
        container_id, sock = job.result()
        if sock is not None:
            sock.close()
        submit(remove_container, api, container_id)
    return callback


async def start_container(api: APIClient, spec: SandboxSpec, limiter: ProvisionLimiter, *,
                          runtime: str = "runc") -> StartedContainer:
    """Create, attach to (before start, so no output is missed) and start one sandbox container."""
    if spec.network.mode != "none" or spec.limits.disk is not None:
        await run_blocking(check_supported, api, spec)
    name = container_name(spec)
    uid, gid = command_user(api, spec) if spec.user is not None else await run_blocking(command_user, api, spec)
    kwargs = create_kwargs(api, spec, name=name, now=time.time(), runtime=runtime)
    tls = tls_transport(api)
    async with limiter.slot():
        job = submit(_create_attach_start, api, kwargs, spec.session and not tls, start=not (spec.session and tls))
        try:
            container_id, sock = await asyncio.shield(asyncio.wrap_future(job))
        except asyncio.CancelledError:
            job.add_done_callback(_discard_when_created(api))
            raise
        shell = await _attach_tls_and_start(api, container_id) if spec.session and tls else sock
    return StartedContainer(id=container_id, name=name, shell_socket=shell, uid=uid, gid=gid)


async def _attach_tls_and_start(api: APIClient, container_id: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Over TLS: attach (asyncio-native), then start; on any failure or cancellation the container
    is removed (in the docker pool, finishing even if nobody awaits it)."""
    streams = None
    try:
        streams = await tls_attach.attach(api, container_id)
        await run_blocking(api.start, container_id)
        return streams
    except BaseException:
        if streams is not None:
            streams[1].close()
        submit(remove_container, api, container_id)
        raise
