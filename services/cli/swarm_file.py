"""The compose file, rendered for ``docker stack deploy`` on a swarm.

``docker stack deploy`` reads the compose file with an older schema than compose v2 and
docker-compose 1.29 do. It refuses ``depends_on`` conditions and GPU ``devices`` reservations,
and it ignores ``restart``, ``profiles`` and ``shm_size``. So the stack is deployed from the
*same* ``compose/docker-compose.yml``, resolved by compose itself (``config``: env file, anchors,
profiles), then translated here. Nothing is maintained twice.

Translation (``to_swarm``), invariants:
- Services outside the active profiles are dropped; ``profiles`` and ``depends_on`` go (every
  service waits for what it needs itself, and a swarm restarts a task that exits early).
- ``restart`` becomes ``deploy.restart_policy``: ``no`` and ``on-failure`` -> ``on-failure``
  (a one-shot step such as model-init or intake that ran before its dependencies were up is
  tried again; one that succeeded stays done), anything else -> ``any``.
- ``shm_size`` becomes a tmpfs on ``/dev/shm`` of that size (vLLM's shared-memory buffers).
- Every service resolves by DNS round-robin (``endpoint_mode: dnsrr``) and publishes in
  ``host`` mode: the swarm's virtual IPs and routing mesh need the kernel's IPVS (``ip_vs``),
  which many VMs and CI machines lack (there, every VIP answers "no route to host"). Each
  published service runs one replica, so nothing is lost.
- Published ports lose their host address (the stack file format cannot bind one): they are
  on every interface of the node. Redis and Flower keep their passwords; firewall the ports.
- Networks are ``overlay`` and attachable, so a ``docker run`` on another node can join.
- ``$`` stays escaped as ``$$``: ``docker stack deploy`` interpolates the file once more.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

RESTART_POLICIES = {"no": "on-failure", "on-failure": "on-failure"}
DROPPED_KEYS = ("profiles", "depends_on", "restart", "shm_size", "container_name")


def _bytes(size: str | int) -> int:
    if isinstance(size, int):
        return size
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = str(size).strip().lower().rstrip("b")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)


def _port(spec: str | dict) -> dict:
    if isinstance(spec, dict):
        return {**{k: v for k, v in spec.items() if k in ("target", "published", "protocol")}, "mode": "host"}
    text, _, protocol = str(spec).partition("/")
    parts = text.split(":")
    published, target = (parts[-2], parts[-1]) if len(parts) >= 2 else (parts[-1], parts[-1])
    return {"target": int(target), "published": int(published), "protocol": protocol or "tcp", "mode": "host"}


def _service(service: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in service.items() if k not in DROPPED_KEYS}
    deploy = dict(out.get("deploy") or {})
    restart = str(service.get("restart", "always")).strip("'\"")
    deploy["restart_policy"] = {"condition": RESTART_POLICIES.get(restart, "any"), "delay": "5s"}
    deploy["endpoint_mode"] = "dnsrr"
    reservations = (deploy.get("resources") or {}).get("reservations") or {}
    reservations.pop("devices", None)
    out["deploy"] = deploy
    if "shm_size" in service:
        tmpfs = {"type": "tmpfs", "target": "/dev/shm", "tmpfs": {"size": _bytes(service["shm_size"])}}
        out["volumes"] = [*out.get("volumes", []), tmpfs]
    if "ports" in out:
        out["ports"] = [_port(p) for p in out["ports"]]
    if isinstance(out.get("networks"), dict):
        out["networks"] = list(out["networks"])
    return out


def to_swarm(resolved: dict[str, Any], profiles: tuple[str, ...] = ("cpu",)) -> dict[str, Any]:
    """A stack file from a compose file already resolved by ``compose config``."""
    services = {name: _service(svc) for name, svc in resolved["services"].items()
                if not svc.get("profiles") or set(svc["profiles"]) & set(profiles)}
    networks = {name: {**(net or {}), "driver": "overlay", "attachable": True}
                for name, net in (resolved.get("networks") or {}).items()}
    return {"version": "3.8", "services": services, "networks": networks,
            "volumes": {name: (vol or {}) for name, vol in (resolved.get("volumes") or {}).items()}}


def _escape_dollars(node: Any) -> Any:
    """``compose config`` prints ``$$`` as given, but a ``$`` that came from the env file as a
    value would reach ``stack deploy`` unescaped; escape every lone one."""
    if isinstance(node, str):
        return node.replace("$$", "\0").replace("$", "$$").replace("\0", "$$")
    if isinstance(node, list):
        return [_escape_dollars(v) for v in node]
    if isinstance(node, dict):
        return {k: _escape_dollars(v) for k, v in node.items()}
    return node


def render(compose: list[str], compose_file: Path, env_file: Path, profiles: tuple[str, ...], out: Path) -> Path:
    argv = [*compose, "--env-file", str(env_file), "-f", str(compose_file),
            *(arg for p in profiles for arg in ("--profile", p)), "config"]
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"compose config failed ({' '.join(argv)}): {result.stderr.strip()}")
    stack = _escape_dollars(to_swarm(yaml.safe_load(result.stdout), profiles))
    out.write_text("# rendered by services/cli/swarm_file.py from " + compose_file.name
                   + " for docker stack deploy; do not edit\n" + yaml.safe_dump(stack, sort_keys=False))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="Render compose/docker-compose.yml for `docker stack deploy`.")
    parser.add_argument("--compose", default="docker-compose", help="the compose command (e.g. 'docker compose')")
    parser.add_argument("--file", type=Path, default=Path(__file__).resolve().parents[2] / "compose" / "docker-compose.yml")
    parser.add_argument("--env-file", type=Path, required=True)
    parser.add_argument("--profile", action="append", default=None, help="active profile(s); default: cpu")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    path = render(args.compose.split(), args.file, args.env_file, tuple(args.profile or ("cpu",)), args.out)
    print(path, file=sys.stdout)


if __name__ == "__main__":
    main()
