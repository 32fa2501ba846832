"""Sandbox base images, built offline on the local daemon and tagged by the hash of their inputs.

Invariant: a tag names exactly one recipe: ``repository:<sha256 of every input>[:12]`` (the
Dockerfile and files beside it, the busybox binary, the extra CA bundle, the debootstrap
arguments). An image whose tag exists is reused, never rebuilt; a changed input gives a new tag.
Nothing is pulled from a registry: another daemon gets an image from this one (``ship_image``,
by image id). Blocking: call from async code through ``run_blocking``.
Every image Conveyor builds carries ``image_labels``: its kind (``conveyor.image``) and the stack
that built it (``conveyor.stack``, ``shared.stack_id``); a tag reused by another stack keeps
the label of the stack that built it, and only that stack's pruning may remove it.

- ``busybox``: ``images/busybox/Dockerfile``, FROM scratch plus the host's ``busybox-static``.
  Builds in about a second.
- ``python-base``: Debian (debootstrap ``--variant=minbase``) with python3, imported with
  ``docker import``. Needs root, ``debootstrap`` and a reachable Debian mirror; about 45 s.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import IO, Callable, cast

import docker
import docker.errors

from shared.processes import run_reporting
from shared.stack_id import LABEL_STACK, current_stack_id

from .client import default_client

IMAGES_DIR = Path(__file__).resolve().parents[3] / "images"
LABEL_IMAGE = "conveyor.image"


def image_labels(kind: str, stack_id: str | None = None) -> dict[str, str]:
    """The labels of an image Conveyor builds: its kind and its stack (this process's unless given)."""
    return {LABEL_IMAGE: kind, LABEL_STACK: stack_id or current_stack_id()}


def content_hash(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()[:12]


def image_exists(client: docker.DockerClient, tag: str) -> bool:
    try:
        client.images.get(tag)
        return True
    except docker.errors.ImageNotFound:
        return False


def build_busybox_image(client: docker.DockerClient | None = None, *, busybox: Path | str = "/bin/busybox",
                        ca_bundle: Path | str | None = None, repository: str = "conveyor/busybox") -> str:
    client = client or default_client()
    recipe = IMAGES_DIR / "busybox"
    binary = Path(busybox).read_bytes()
    if b"ld-linux" in binary[:8192]:
        raise RuntimeError(f"{busybox} is dynamically linked; a FROM-scratch image needs busybox-static "
                           "(apt-get install -y busybox-static)")
    ca = Path(ca_bundle).read_bytes() if ca_bundle else b""
    recipe_files = sorted(recipe.iterdir())
    tag = f"{repository}:{content_hash(binary, ca, *(p.name.encode() + p.read_bytes() for p in recipe_files))}"
    if image_exists(client, tag):
        return tag
    with tempfile.TemporaryDirectory(prefix="conveyor-busybox-") as context:
        for path in recipe_files:
            shutil.copy(path, context)
        Path(context, "busybox").write_bytes(binary)
        os.chmod(Path(context, "busybox"), 0o755)
        Path(context, "ca-extra.crt").write_bytes(ca)
        client.images.build(path=context, tag=tag, rm=True, forcerm=True, pull=False,
                            labels=image_labels("busybox"))
    return tag


def build_python_base_image(client: docker.DockerClient | None = None, *, suite: str = "bookworm",
                            include: tuple[str, ...] = ("python3", "ca-certificates"),
                            mirror: str = "http://deb.debian.org/debian", ca_bundle: Path | str | None = None,
                            repository: str = "conveyor/python-base", timeout_s: float = 900,
                            stack_id: str | None = None, report: Callable[[str], None] = lambda _line: None) -> str:
    """The tag of a minimal Debian image with ``include`` installed, built with debootstrap if
    it is not there yet. ``report`` hears that a build starts and then debootstrap's latest line
    every 10 s (a first build takes a minute or more)."""
    client = client or default_client()
    ca = Path(ca_bundle).read_bytes() if ca_bundle else b""
    recipe = f"v1 minbase {suite} {','.join(include)} {mirror}".encode()
    tag = f"{repository}:{content_hash(recipe, ca)}"
    if image_exists(client, tag):
        return tag
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        raise RuntimeError("building python-base needs root and debootstrap (apt-get install -y debootstrap)")
    with tempfile.TemporaryDirectory(prefix="conveyor-python-base-") as tmp:
        root = Path(tmp, "root")
        report(f"building {tag} with debootstrap ({suite} minbase from {mirror})")
        run_reporting(["debootstrap", "--variant=minbase", f"--include={','.join(include)}", suite, str(root), mirror],
                      report, timeout_s=timeout_s)
        _finish_rootfs(root, ca)
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        tar_stdout = cast(IO[bytes], tar.stdout)  # stdout=PIPE: never None
        try:
            repo, _, version = tag.rpartition(":")
            client.api.import_image_from_stream(tar_stdout, repository=repo, tag=version, changes=[
                "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "ENV HOME=/tmp", "WORKDIR /workspace", "USER 1000:1000", 'CMD ["/bin/sh"]',
                "LABEL " + " ".join(f"{k}={v}" for k, v in image_labels("python-base", stack_id).items()),
            ])
        finally:
            tar_stdout.close()
            if tar.wait() != 0:
                raise RuntimeError(f"tar of the debootstrap root failed (exit {tar.returncode})")
    return tag


def _finish_rootfs(root: Path, ca: bytes) -> None:
    """A sandbox user, an empty /workspace, the extra CA trusted, and no apt caches."""
    with open(root / "etc/passwd", "a") as passwd:
        passwd.write("sandbox:x:1000:1000:sandbox:/workspace:/bin/sh\n")
    with open(root / "etc/group", "a") as group:
        group.write("sandbox:x:1000:\n")
    workspace = root / "workspace"
    workspace.mkdir(exist_ok=True)
    os.chown(workspace, 1000, 1000)
    if ca:
        (root / "usr/local/share/ca-certificates").mkdir(parents=True, exist_ok=True)
        (root / "usr/local/share/ca-certificates/conveyor-extra.crt").write_bytes(ca)
        bundle = root / "etc/ssl/certs/ca-certificates.crt"
        if bundle.exists():
            with open(bundle, "ab") as out:
                out.write(b"\n" + ca)
    for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for entry in (root / cache).glob("*"):
            if entry.is_file():
                entry.unlink()


def ship_image(tag: str, *, source: docker.DockerClient, target: docker.DockerClient) -> str:
    """Make ``tag`` on ``source`` available under the same tag on ``target`` (another daemon),
    keyed by content: the image id (the sha256 of its config) is what is compared, so an image
    the target already holds is only tagged, never sent again, and a tag that names other content
    there is moved to this one. Otherwise ``docker save`` is streamed into ``docker load``; the
    id the target then holds must be the source's. Returns the id. Blocking."""
    image = source.images.get(tag)
    if not image_exists(target, image.id):
        target.images.load(image.save(named=True))
        held = target.images.get(tag)
        if held.id != image.id:
            raise RuntimeError(f"{tag} arrived as {held.id}, not {image.id}")
    held = target.images.get(image.id)
    if tag not in held.tags:
        repository, _, version = tag.rpartition(":")
        held.tag(repository, version)
    return image.id
