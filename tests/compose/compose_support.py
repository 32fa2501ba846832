"""Helpers of the compose and swarm tests: the test secrets, the compose command, a compose
project handle (``Stack``) and the env file both stacks are started from.

``HEAD_ADDRESS`` is an address of this host that containers on any Docker network reach (the
default bridge's gateway): it stands in for the head host's LAN address, so Redis, S3 and
inference are published there and a second compose project can reach them only that way.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.cli.stack_images import StackImages
from shared.state.ledger import Ledger

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose" / "docker-compose.yml"
SECRETS = {"REDIS_PASSWORD": "t-redis-" + uuid.uuid4().hex[:8], "S3_ACCESS_KEY": "t-access",
           "S3_SECRET_KEY": "t-secret-" + uuid.uuid4().hex[:8], "FLOWER_USER": "t-user",
           "FLOWER_PASSWORD": "t-flower-" + uuid.uuid4().hex[:8]}


def compose_command() -> list[str]:
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.skip("needs docker compose v2 or docker-compose")


@dataclass
class Stack:
    project: str
    env_file: Path
    ports: dict[str, int]
    compose: list[str]
    overrides: tuple[Path, ...] = ()
    profiles: tuple[str, ...] = ("cpu",)

    def command(self) -> list[str]:
        """The project's compose command line, before the compose subcommand (what the docs
        write as ``docker-compose ...``)."""
        files = [arg for f in (COMPOSE_FILE, *self.overrides) for arg in ("-f", str(f))]
        profiles = [arg for profile in self.profiles for arg in ("--profile", profile)]
        return [*self.compose, "-p", self.project, "--env-file", str(self.env_file), *files, *profiles]

    def dc(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        result = subprocess.run([*self.command(), *args], capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result

    def container(self, service: str) -> str:
        ids = self.dc("ps", "-q", service).stdout.split()
        assert ids, f"no container for {service}"
        return ids[0]

    def conveyor(self, *args: str) -> str:
        return self.dc("exec", "-T", "scorer", "conveyor", *args).stdout

    def logs(self, service: str) -> str:
        return self.dc("logs", "--no-color", service, check=False).stdout

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={self.project}"
        return {kind: subprocess.run(["docker", *cmd, "-q", "--filter", label], capture_output=True, text=True,
                                     check=True).stdout.split()
                for kind, cmd in (("container", ["ps", "-a"]), ("network", ["network", "ls"]),
                                  ("volume", ["volume", "ls"]))}

    def tear_down(self) -> None:
        """``stop``, then ``down -v``; prove that every running service stopped on SIGTERM (none was
        killed at the timeout) and that nothing of the project is left. What is left is removed by
        force (so one failure does not fill the disk) and the teardown fails."""
        running = self.dc("ps", "-q", check=False).stdout.split()
        self.dc("stop", "-t", "30", check=False, timeout=600)
        killed = [name for name, code in _exit_codes(running).items() if code == 137]  # SIGKILL: SIGTERM was ignored
        result = self.dc("down", "-v", "--remove-orphans", "-t", "30", check=False, timeout=600)
        left = {kind: ids for kind, ids in self.leftovers().items() if ids}
        for kind, ids in left.items():
            subprocess.run(["docker", *({"container": ["rm", "-f"]}.get(kind, [kind, "rm"])), *ids], capture_output=True)
        assert not left, f"down left {left} behind:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
        assert not killed, f"{killed} ignored SIGTERM and were killed after 30 s: `make down` waits for each"

    def ledger(self) -> Ledger:
        """The head's ledger, read from this host through Redis's published port."""
        return Ledger.from_url(f"redis://:{SECRETS['REDIS_PASSWORD']}@{HEAD_ADDRESS}:{self.ports['redis']}/0")


def doc_commands(containing: str, doc: Path = ROOT / "docs" / "compose.md") -> list[str]:
    """The command lines of the one fenced block of ``doc`` that holds ``containing``."""
    blocks = [b for b in re.findall(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", doc.read_text(), re.M | re.S) if containing in b]
    assert len(blocks) == 1, f"{len(blocks)} blocks of {doc} hold {containing!r}"
    return [line.strip() for line in blocks[0].splitlines() if line.strip() and not line.strip().startswith("#")]


HOST_COMMANDS = {"chmod", "cp", "docker"}  # what a doc line may run on the host, outside compose and the script


def run_as_written(stack: Stack | None, line: str, cwd: Path, timeout: float = 600, env: dict[str, str] | None = None,
                   examples: dict[str, str] | None = None) -> str:
    """A command line of the docs, by the shell in ``cwd``; returns its stdout. ``docker-compose ...``
    stands for the stack's compose command. ``scripts/stack.sh`` is the checkout's (``cwd/scripts``
    links to it), driving this stack: its project, compose command, stack id and settings
    (``PROJECT``, ``COMPOSE``, ``CONVEYOR_STACK_ID``, ``ENV_DIR`` holding its env file as ``.env``);
    the line may set variables before it (``CONVEYOR_HEAD=... scripts/stack.sh ...``).
    ``stack`` None: a host line alone. ``env``: the host's environment (default: this process's).
    ``examples``: an example value the doc writes (an address) -> what stands for it here; each
    must be in the line."""
    env = dict(os.environ if env is None else env)
    for example, value in (examples or {}).items():
        assert example in line, (example, line)
        line = line.replace(example, value)
    command = line.split()
    while command and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", command[0]):
        command = command[1:]  # VAR=value before the command
    if stack is None:
        assert line.split()[0] in HOST_COMMANDS, line
    elif line.startswith("docker-compose ... "):
        line = shlex.join(stack.command()) + line[len("docker-compose ..."):]
    elif command[:1] != ["scripts/stack.sh"]:
        assert line.split()[0] in HOST_COMMANDS, line
    else:
        if not (cwd / "scripts").exists():
            (cwd / "scripts").symlink_to(ROOT / "scripts")
        settings = dict(row.split("=", 1) for row in stack.env_file.read_text().splitlines() if "=" in row)
        env_dir = cwd / f"{stack.project}-env"
        env_dir.mkdir(exist_ok=True)
        (env_dir / ".env").write_text(stack.env_file.read_text())
        (env_dir / "images.env").write_text("# the image tags are in .env\n")
        env |= {"PROJECT": stack.project, "COMPOSE": " ".join(stack.compose), "ENV_DIR": str(env_dir),
                "CONVEYOR_STACK_ID": settings.get("CONVEYOR_STACK_ID", stack.project)}
    result = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{line} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def _exit_codes(containers: list[str]) -> dict[str, int]:
    if not containers:
        return {}
    states = json.loads(subprocess.run(["docker", "inspect", *containers], capture_output=True, text=True, check=True).stdout)
    return {s["Name"].lstrip("/"): s["State"]["ExitCode"] for s in states}


def docker_host_address() -> str:
    info = json.loads(subprocess.run(["docker", "network", "inspect", "bridge"], capture_output=True, text=True,
                                     check=True).stdout)[0]
    ipam = info["IPAM"]["Config"][0]
    # dockerd leaves Gateway out when it takes over an existing docker0: the default is the
    # subnet's first host address
    return ipam.get("Gateway") or str(next(ipaddress.ip_network(ipam["Subnet"]).hosts()))


HEAD_ADDRESS = docker_host_address() if shutil.which("docker") else "127.0.0.1"




# `docker-compose run -e` flags for a run of the guess-the-number demo (`intake --demo-tasks N`,
# whose --demo is guess) on a stack whose .env holds the digit demo: groups of 4, each task once
GUESS_RUN = ["-e", "CONVEYOR_ROLLOUT__GROUP_SIZE=4", "-e", "CONVEYOR_INTAKE__MODE=traversal"]


def example_env() -> dict[str, str]:
    """compose/.env.example's variables and the test secrets."""
    return {**dict(line.split("=", 1) for line in (ROOT / "compose" / ".env.example").read_text().splitlines()
                   if line and not line.startswith("#")), **SECRETS}


def stack_env(images: StackImages, ports: dict[str, int], **overrides: str) -> dict[str, str]:
    """The env file's variables: .env.example, the test secrets, the image tags, and the ports."""
    return {
        **example_env(),
        **dict(line.split("=", 1) for line in images.env_lines()),
        "DOCKER_GID": str(os.stat("/var/run/docker.sock").st_gid),
        "REDIS_PUBLISH": f"{HEAD_ADDRESS}:{ports['redis']}", "S3_PUBLISH": f"{HEAD_ADDRESS}:{ports['s3']}",
        "INFERENCE_PUBLISH": f"{HEAD_ADDRESS}:{ports['inference']}", "FLOWER_PUBLISH": f"127.0.0.1:{ports['flower']}",
        **({"VIEWER_PUBLISH": f"127.0.0.1:{ports['viewer']}"} if "viewer" in ports else {}),
        **overrides,
    }


def write_env(path: Path, env: dict[str, str]) -> Path:
    path.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    return path
