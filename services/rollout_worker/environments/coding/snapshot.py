"""Per-repo snapshot images: the workspace at ``base_commit`` plus its setup, built once per group.

``FROM <language image>``, the workspace copied to ``/workspace``, the task's setup commands run
there as root at build time (e.g. ``pip install -e .``; the build has no network unless
``network_mode`` says so), then the result copied to ``/opt/conveyor/workspace``. A sandbox starts
from the image and fills its (tmpfs) ``/workspace`` from that copy with one local ``cp`` instead
of streaming the archive over the daemon socket; paths that setup recorded (editable installs)
stay valid because the tree lives at ``/workspace`` in both places.

Invariants:
- The tag is ``conveyor/snapshot:<hash>`` of the base image's id, the workspace's content key and
  base commit, and the setup commands: the same inputs reuse the image, any change builds a new one.
- Built at most once per tag per process (a lock per tag); nothing is pulled.
- The snapshot holds what the agent's workspace holds and nothing else of the task (no tests).
Blocking: call ``build_snapshot`` through ``asyncio.to_thread``.
"""

from __future__ import annotations

import io
import tarfile
import threading

import docker

from services.rollout_worker.sandbox.client import default_client
from services.rollout_worker.sandbox.images import content_hash, image_exists, image_labels

from .repo import Workspace

SNAPSHOT_REPOSITORY = "conveyor/snapshot"
SNAPSHOT_DIR = "/opt/conveyor/workspace"
_locks: dict[str, threading.Lock] = {}
_guard = threading.Lock()

DOCKERFILE = """\
FROM {base}
USER root
COPY workspace /workspace
{setup}
RUN mkdir -p /opt/conveyor && cp -a /workspace {snapshot_dir} && chmod -R a+rX {snapshot_dir}
LABEL conveyor.image=snapshot conveyor.workspace={key}
"""


def populate_command(workspace_dir: str) -> str:
    """Run in the sandbox: copy the snapshot into the (empty, tmpfs) workspace."""
    return f"cp -R {SNAPSHOT_DIR}/. {workspace_dir}/"


def snapshot_tag(base_id: str, workspace: Workspace, setup: tuple[str, ...]) -> str:
    parts = [base_id.encode(), workspace.key.encode(), workspace.base_sha.encode(), *(c.encode() for c in setup)]
    return f"{SNAPSHOT_REPOSITORY}:{content_hash(*parts)}"


def build_snapshot(base_image: str, workspace: Workspace, setup: tuple[str, ...] = (), *,
                   client: docker.DockerClient | None = None, network_mode: str = "none") -> str:
    client = client or default_client()
    tag = snapshot_tag(client.images.get(base_image).id, workspace, setup)
    with _guard:
        lock = _locks.setdefault(tag, threading.Lock())
    with lock:
        if image_exists(client, tag):
            return tag
        setup_lines = "\n".join(f"RUN cd /workspace && {command}" for command in setup)
        dockerfile = DOCKERFILE.format(base=base_image, setup=setup_lines, snapshot_dir=SNAPSHOT_DIR, key=workspace.key)
        context = _context(dockerfile, workspace.archive)
        try:
            client.images.build(fileobj=io.BytesIO(context), custom_context=True, tag=tag, rm=True, forcerm=True,
                                pull=False, network_mode=network_mode, labels=image_labels("snapshot"))
        except docker.errors.BuildError as exc:
            log = "".join(str(line.get("stream") or line.get("error") or "") for line in exc.build_log)
            raise RuntimeError(f"snapshot build failed: {exc}: {log[-1500:]}") from None
        return tag


def _context(dockerfile: str, workspace_archive: bytes) -> bytes:
    """A build context: the Dockerfile and the workspace archive's entries under ``workspace/``."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as context:
        data = dockerfile.encode()
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(data)
        context.addfile(info, io.BytesIO(data))
        root = tarfile.TarInfo("workspace")
        root.type, root.mode = tarfile.DIRTYPE, 0o755
        context.addfile(root)
        with tarfile.open(fileobj=io.BytesIO(workspace_archive), mode="r") as source:
            for member in source.getmembers():
                payload = source.extractfile(member) if member.isfile() else None
                member.name = f"workspace/{member.name}"
                if member.islnk():
                    member.linkname = f"workspace/{member.linkname}"
                context.addfile(member, payload)
    return out.getvalue()
