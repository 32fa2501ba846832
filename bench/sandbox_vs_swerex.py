"""Conveyor's sandbox against swe-rex 1.4's DockerDeployment, side by side, same image and machine.

    .venv/bin/python bench/sandbox_vs_swerex.py [--swerex-python /tmp/swerex-venv/bin/python]
                                                [--first 10] [--commands 1000] [--swerex-commands 200]

swe-rex is never installed into Conveyor's venv: it lives in a separate venv
(``python3.11 -m venv /tmp/swerex-venv && /tmp/swerex-venv/bin/pip install 'swe-rex==1.4.*' aiohttp``;
aiohttp is an undeclared dependency of swe-rex's client). This script runs its swe-rex half by
re-invoking itself with that venv's python (``--swerex-worker``), which prints JSON back.

The image: ``conveyor/swerex-bench:<hash>``, FROM the debootstrap python base
(``images.build_python_base_image()``), with swe-rex + aiohttp pip-installed from wheels that the
swe-rex venv's pip downloads on the host (so the build itself is offline) and ``swerex-remote`` on
PATH. Both sides start containers from this one image.

Measured, in one run:
- start to first command output: swe-rex ``DockerDeployment(image, pull="never").start()`` +
  ``create_session`` + ``run_in_session("echo ready")``, against Conveyor's
  ``Sandbox.provision`` + ``exec("echo ready")``;
- per-command round trip p50/p95 of a builtin (``true``) through swe-rex's bash session against
  Conveyor's persistent session.
Every container carries ``conveyor.run_id=<this run>`` and is removed at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_ID = "bench-swerex-" + uuid.uuid4().hex[:8]
DEFAULT_SWEREX_PYTHON = "/tmp/swerex-venv/bin/python"
WHEELS_DIR = Path(os.environ.get("SWEREX_WHEELS", "/tmp/conveyor-swerex-wheels"))

DOCKERFILE = """\
# swe-rex's remote server on the debootstrap python base; wheels come from the build context.
ARG BASE
FROM ${BASE}
USER root
COPY wheels/ /tmp/wheels/
RUN python3 "$(echo /tmp/wheels/pip-*.whl)/pip" install --no-index --find-links /tmp/wheels --no-cache-dir \\
        --break-system-packages swe-rex aiohttp \\
 && rm -rf /tmp/wheels && python3 -c "import swerex.server, aiohttp" && command -v swerex-remote
USER 1000:1000
"""


def quantiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


# -- swe-rex half: runs under the swe-rex venv's python, imports nothing from Conveyor -------------

async def swerex_worker(image: str, run_id: str, first: int, commands: int) -> dict:
    from swerex.deployment.docker import DockerDeployment
    from swerex.runtime.abstract import BashAction, CreateBashSessionRequest

    def deployment(i: int) -> DockerDeployment:
        labels = ["--label", f"conveyor.run_id={run_id}", "--label", f"conveyor.trajectory_id={run_id}_swerex_{i}"]
        return DockerDeployment(image=image, pull="never", docker_args=labels)

    start_s, first_output_s, stop_s = [], [], []
    for i in range(first + 1):  # the first round warms caches and is not kept
        dep = deployment(i)
        t0 = time.perf_counter()
        try:
            await dep.start()
            t1 = time.perf_counter()
            await dep.runtime.create_session(CreateBashSessionRequest())
            out = await dep.runtime.run_in_session(BashAction(command="echo ready", check="raise"))
            t2 = time.perf_counter()
            assert out.output.strip() == "ready", out
        finally:
            t3 = time.perf_counter()
            await dep.stop()
            t4 = time.perf_counter()
        if i:
            start_s.append(t1 - t0)
            first_output_s.append(t2 - t0)
            stop_s.append(t4 - t3)

    dep = deployment(first + 1)
    round_trips = []
    try:
        await dep.start()
        await dep.runtime.create_session(CreateBashSessionRequest())
        for _ in range(20):
            await dep.runtime.run_in_session(BashAction(command="true"))
        for _ in range(commands):
            t0 = time.perf_counter()
            out = await dep.runtime.run_in_session(BashAction(command="true", check="raise"))
            round_trips.append(time.perf_counter() - t0)
            assert out.exit_code == 0, out
    finally:
        await dep.stop()
    import swerex
    return {"version": getattr(swerex, "__version__", "1.4"), "start_s": start_s,
            "first_output_s": first_output_s, "stop_s": stop_s, "round_trip_s": round_trips}


# -- Conveyor half ---------------------------------------------------------------------------------

def ensure_wheels(swerex_python: str) -> Path:
    if not any(WHEELS_DIR.glob("swe_rex-1.4.*.whl")):
        WHEELS_DIR.mkdir(parents=True, exist_ok=True)
        subprocess.run([swerex_python, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(WHEELS_DIR),
                        "swe-rex==1.4.*", "aiohttp", "pip"], check=True)
    return WHEELS_DIR


def build_swerex_image(client, base_image: str, wheels: Path) -> str:
    from services.rollout_worker.sandbox.images import content_hash, image_exists

    files = sorted(wheels.glob("*.whl"))
    base_id = client.images.get(base_image).id
    tag = "conveyor/swerex-bench:" + content_hash(DOCKERFILE.encode(), base_id.encode(),
                                                  *(p.name.encode() + p.read_bytes() for p in files))
    if image_exists(client, tag):
        return tag
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = DOCKERFILE.encode()
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        for path in files:
            tar.add(str(path), arcname=f"wheels/{path.name}")
    buf.seek(0)
    t0 = time.perf_counter()
    client.images.build(fileobj=buf, custom_context=True, tag=tag, rm=True, forcerm=True, pull=False,
                        buildargs={"BASE": base_image}, network_mode="none",
                        labels={"conveyor.image": "swerex-bench"})
    print(f"built {tag} in {time.perf_counter() - t0:.1f} s")
    return tag


async def conveyor_side(image: str, first: int, commands: int) -> dict:
    from services.rollout_worker.sandbox import Sandbox, SandboxLabels, SandboxSpec

    def spec(i: int) -> SandboxSpec:
        return SandboxSpec(image=image, labels=SandboxLabels(run_id=RUN_ID, group_id="bench",
                                                             trajectory_id=f"{RUN_ID}_conveyor_{i}"))

    first_output_s, teardown_s = [], []
    for i in range(first + 1):
        t0 = time.perf_counter()
        sandbox = await Sandbox.provision(spec(i))
        try:
            result = await sandbox.exec("echo ready")
            t1 = time.perf_counter()
            assert result.output == "ready\n", result
        finally:
            t2 = time.perf_counter()
            await sandbox.teardown()
            t3 = time.perf_counter()
        if i:
            first_output_s.append(t1 - t0)
            teardown_s.append(t3 - t2)

    round_trips = []
    async with await Sandbox.provision(spec(first + 1)) as sandbox:
        for _ in range(50):
            await sandbox.exec("true")
        for _ in range(commands):
            t0 = time.perf_counter()
            result = await sandbox.exec("true")
            round_trips.append(time.perf_counter() - t0)
            assert result.exit_code == 0, result
    return {"first_output_s": first_output_s, "stop_s": teardown_s, "round_trip_s": round_trips}


def report(image: str, conveyor: dict, swerex: dict) -> None:
    def fmt(samples: list[float]) -> str:
        p50, p95 = quantiles(samples)
        return f"p50 {p50 * 1e3:9.2f} ms  p95 {p95 * 1e3:9.2f} ms  n={len(samples)}"

    print(f"\nswe-rex {swerex['version']} vs Conveyor  image={image}  run={RUN_ID}  cpus={os.cpu_count()}")
    print("start to first command output (`echo ready`):")
    print(f"  swe-rex  start() only                      {fmt(swerex['start_s'])}")
    print(f"  swe-rex  start()+create_session+run        {fmt(swerex['first_output_s'])}")
    print(f"  Conveyor Sandbox.provision + exec          {fmt(conveyor['first_output_s'])}")
    print("teardown (not part of the comparison):")
    print(f"  swe-rex  stop()                            {fmt(swerex['stop_s'])}")
    print(f"  Conveyor teardown()                        {fmt(conveyor['stop_s'])}")
    print("per-command round trip (`true`):")
    print(f"  swe-rex  run_in_session                    {fmt(swerex['round_trip_s'])}")
    print(f"  Conveyor persistent session exec           {fmt(conveyor['round_trip_s'])}")
    s_first, c_first = quantiles(swerex["first_output_s"]), quantiles(conveyor["first_output_s"])
    s_rt, c_rt = quantiles(swerex["round_trip_s"]), quantiles(conveyor["round_trip_s"])
    print("ratios (swe-rex / Conveyor):")
    print(f"  first output   p50 {s_first[0] / c_first[0]:6.1f}x   p95 {s_first[1] / c_first[1]:6.1f}x")
    print(f"  round trip     p50 {s_rt[0] / c_rt[0]:6.1f}x   p95 {s_rt[1] / c_rt[1]:6.1f}x")
    summary = {"image": image, "swerex_version": swerex["version"],
               "first_output_p50_s": {"swerex": s_first[0], "conveyor": c_first[0]},
               "first_output_p95_s": {"swerex": s_first[1], "conveyor": c_first[1]},
               "round_trip_p50_s": {"swerex": s_rt[0], "conveyor": c_rt[0]},
               "round_trip_p95_s": {"swerex": s_rt[1], "conveyor": c_rt[1]},
               "ratio_first_output_p50": s_first[0] / c_first[0], "ratio_round_trip_p50": s_rt[0] / c_rt[0]}
    print("summary " + json.dumps(summary))


def cleanup(client) -> int:
    leftovers = client.api.containers(all=True, filters={"label": f"conveyor.run_id={RUN_ID}"})
    for info in leftovers:
        try:
            client.api.remove_container(info["Id"], force=True, v=True)
        except Exception as exc:  # noqa: BLE001 - best effort; reported below
            print(f"could not remove {info['Id'][:12]}: {exc}", file=sys.stderr)
    return len(leftovers)


def main(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    from services.rollout_worker.sandbox.client import default_client
    from services.rollout_worker.sandbox.images import build_python_base_image

    client = default_client()
    try:
        base = build_python_base_image(client)
        image = args.image or build_swerex_image(client, base, ensure_wheels(args.swerex_python))
        print(f"base={base} image={image}")
        conveyor = asyncio.run(conveyor_side(image, args.first, args.commands))
        proc = subprocess.run([args.swerex_python, __file__, "--swerex-worker", "--image", image, "--run-id", RUN_ID,
                               "--first", str(args.first), "--swerex-commands", str(args.swerex_commands)],
                              stdout=subprocess.PIPE, text=True, check=True, cwd="/tmp")
        swerex = json.loads(proc.stdout.strip().splitlines()[-1])
        report(image, conveyor, swerex)
    finally:
        removed = cleanup(client)
        if removed:
            print(f"removed {removed} containers left by this run", file=sys.stderr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--swerex-python", default=DEFAULT_SWEREX_PYTHON)
    parser.add_argument("--image", help="skip the build; use this image (must have swerex-remote on PATH)")
    parser.add_argument("--first", type=int, default=10, help="start-to-first-output samples per side")
    parser.add_argument("--commands", type=int, default=1000, help="Conveyor round trips")
    parser.add_argument("--swerex-commands", type=int, default=200, help="swe-rex round trips")
    parser.add_argument("--swerex-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-id", help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    if parsed.swerex_worker:
        result = asyncio.run(swerex_worker(parsed.image, parsed.run_id, parsed.first, parsed.swerex_commands))
        print(json.dumps(result))
    else:
        main(parsed)
