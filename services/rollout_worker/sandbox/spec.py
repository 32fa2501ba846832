"""What a sandbox is made of: image, user, limits, timeouts, network policy and labels.

Invariant: a ``SandboxSpec`` that validates describes an isolated sandbox. Every default is the
safe choice (no network, 65534:65534, bounded memory/CPU/pids, bounded writable space, short
timeouts); loosening one is an explicit field. Unknown fields are rejected (``extra="forbid"``),
so a typo in a config file is an error, never a silently ignored limit.
"""

from __future__ import annotations

import posixpath
import re
from typing import Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator, model_validator

from shared.stack_id import current_stack_id

_LABEL_VALUE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@/+=-]{0,199}$")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Limits(_Model):
    memory: ByteSize = ByteSize(1 << 30)  # swap is disabled: memswap = memory
    cpus: float = Field(1.0, gt=0, le=64)
    pids: int = Field(256, ge=16)
    # Writable space is bounded by tmpfs sizes (their pages count against `memory`); the root
    # filesystem is read-only. `disk` is a quota on the container's root layer, which the daemon
    # honours only for overlay2 on xfs with pquota; elsewhere provisioning fails with a clear error.
    workspace_size: ByteSize = ByteSize(512 << 20)
    tmp_size: ByteSize = ByteSize(256 << 20)
    disk: ByteSize | None = None


class Timeouts(_Model):
    provision_s: float = Field(60.0, gt=0)  # request → sandbox answers, workspace copied in
    command_s: float = Field(120.0, gt=0)  # default per exec; a call may ask for less or more
    episode_s: float = Field(1800.0, gt=0)  # from provisioned to the last command
    kill_grace_s: float = Field(5.0, gt=0)  # after killing a command, how long its shell may take to answer


class NetworkPolicy(_Model):
    """``none``: the container has only a loopback interface. ``allowlist``: egress to the listed
    ``host:port`` pairs only, through an egress proxy (not implemented yet: provisioning refuses it)."""

    mode: Literal["none", "allowlist"] = "none"
    allow: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _allow_needs_allowlist(self) -> NetworkPolicy:
        if self.allow and self.mode != "allowlist":
            raise ValueError("network.allow is only meaningful with network.mode='allowlist'")
        return self


class SandboxLabels(_Model):
    run_id: str
    group_id: str
    trajectory_id: str
    # the stack whose janitor may remove the sandbox (shared.stack_id): this process's, unless told
    stack_id: str = Field(default_factory=current_stack_id)

    @field_validator("run_id", "group_id", "trajectory_id", "stack_id")
    @classmethod
    def _label_value(cls, value: str) -> str:
        if not _LABEL_VALUE.match(value):
            raise ValueError(f"{value!r} is not a usable label value (letters, digits, _.:@/+=-, at most 200)")
        return value


class SandboxSpec(_Model):
    type: Literal["docker"] = "docker"
    image: str
    labels: SandboxLabels
    workspace_dir: str = "/workspace"
    # "uid:gid" (numeric works in any image) or a user name the image defines; None = the image's USER.
    user: str | None = "65534:65534"
    env: dict[str, str] = Field(default_factory=dict)
    limits: Limits = Limits()
    timeouts: Timeouts = Timeouts()
    network: NetworkPolicy = NetworkPolicy()
    max_output_bytes: int = Field(64 << 10, gt=0)  # default cap on one command's kept output
    output_flood_bytes: int = Field(16 << 20, gt=0)  # a command that prints more is killed
    session: bool = True  # a persistent shell on an attached socket; False: one `docker exec` per command
    # A host directory holding exactly one trajectory's agent-proxy socket, mounted read-only at
    # protocol.AGENT_DIR: the one way out of a network-less sandbox (agents.proxy.server). None: no mount.
    agent_socket_dir: str | None = None
    ttl_s: float | None = Field(None, gt=0)  # janitor deadline; default: provision + episode + 5 min

    @field_validator("workspace_dir")
    @classmethod
    def _absolute(cls, value: str) -> str:
        norm = posixpath.normpath(value)
        if not norm.startswith("/") or norm in ("/", "/tmp") or norm.startswith(("/proc", "/sys", "/dev")):
            raise ValueError(f"workspace_dir must be an absolute path outside /, /tmp, /proc, /sys, /dev; "
                             f"got {value!r}")
        return norm

    @field_validator("agent_socket_dir")
    @classmethod
    def _socket_dir_absolute(cls, value: str | None) -> str | None:
        if value is not None and (not value.startswith("/") or posixpath.normpath(value) in ("/", "/var/run", "/run")):
            raise ValueError(f"agent_socket_dir must be an absolute directory of its own, got {value!r}")
        return value

    @property
    def effective_ttl_s(self) -> float:
        if self.ttl_s is not None:
            return self.ttl_s
        return self.timeouts.provision_s + self.timeouts.episode_s + 300.0

    def for_trajectory(self, *, run_id: str, group_id: str, trajectory_id: str) -> SandboxSpec:
        """The same sandbox, labelled for one trajectory (specs are frozen: this is a copy)."""
        labels = SandboxLabels(run_id=run_id, group_id=group_id, trajectory_id=trajectory_id,
                               stack_id=self.labels.stack_id)
        return self.model_copy(update={"labels": labels})
