"""Images for agents of their own (``agent_coding``): a sandbox image plus an agent's packages.

A recipe is ``images/agents/<agent>/``: a ``Dockerfile`` (``FROM ${BASE}``, copies ``site``),
``requirements.txt`` (installed with their dependencies) and ``package.txt`` (the agent itself,
installed ``--no-deps`` on top, so extras it does not need at run time stay out).

Invariants:
- Packages are installed on the host with this interpreter's pip into the build context
  (``pip install --target``) and copied into the image: the image's build fetches nothing,
  and the sandbox, which has no network, never installs anything. The base image's Python must
  have this interpreter's minor version (compiled wheels); a mismatch is refused with both
  versions named.
- A tag names one recipe on one base: ``conveyor/agent-<agent>:<hash of the recipe's files and
  the base image id>``. An existing tag is reused, never rebuilt. Blocking.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import docker

from services.rollout_worker.sandbox.images import IMAGES_DIR, content_hash, image_exists

AGENTS_DIR = IMAGES_DIR / "agents"
RECIPE_FILES = ("Dockerfile", "requirements.txt", "package.txt")


def agent_image_tag(client: docker.DockerClient, agent: str, base_image: str) -> str:
    recipe = AGENTS_DIR / agent
    if not recipe.is_dir():
        known = sorted(p.name for p in AGENTS_DIR.iterdir() if p.is_dir())
        raise ValueError(f"no agent recipe {agent!r} under {AGENTS_DIR} (known: {', '.join(known)})")
    base_id = client.images.get(base_image).id
    digest = content_hash(*(recipe.joinpath(name).read_bytes() for name in RECIPE_FILES), base_id.encode())
    return f"conveyor/agent-{agent}:{digest}"


def build_agent_image(client: docker.DockerClient, agent: str, base_image: str) -> str:
    """The agent's image on ``base_image``: reused if its tag exists, else built (a minute or two)."""
    tag = agent_image_tag(client, agent, base_image)
    if image_exists(client, tag):
        return tag
    _check_python(client, base_image)
    recipe = AGENTS_DIR / agent
    with tempfile.TemporaryDirectory(prefix=f"agent-{agent}-") as context:
        site = Path(context) / "site"
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target", str(site)]
        for extra, source in ((["-r"], "requirements.txt"), (["--no-deps", "-r"], "package.txt")):
            done = subprocess.run([*pip, *extra, str(recipe / source)], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"pip could not install {agent}'s {source}: {done.stderr[-2000:]}")
        Path(context, "Dockerfile").write_bytes((recipe / "Dockerfile").read_bytes())
        client.images.build(path=context, tag=tag, buildargs={"BASE": base_image}, rm=True, forcerm=True,
                            labels={"conveyor.image": f"agent-{agent}"})
    return tag


def _check_python(client: docker.DockerClient, base_image: str) -> None:
    version = client.containers.run(base_image, ["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                    remove=True, network_mode="none").decode().strip()
    here = "%d.%d" % sys.version_info[:2]
    if version != here:
        raise RuntimeError(f"{base_image} has Python {version}, this interpreter {here}: the agent's compiled "
                           f"packages would not load there; build with a Python {version} interpreter")
