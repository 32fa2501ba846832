"""Sandboxes started at once (issue 30, item 3): a burst through the sandbox API against one
after the other, and a worker killed with kill -9 halfway through a burst.

    .venv/bin/python bench/sandbox_burst.py [--size 256] [--sequential 16] [--ttl 20]

Everything goes through ``Sandbox.provision`` with the default limits and the default
provision limiter (``sandbox.DEFAULT_LIMITER``), on the local daemon (or DOCKER_HOST), with the
busybox image built offline. Prints:
- sequential: ``--sequential`` sandboxes one after the other (each kept, as in the burst, and
  torn down after the clock stops); time from the provision request to the first command's
  output (p50, p99) and sandboxes per second;
- burst: ``--size`` provisions requested in the same instant; the same times (p50, p99, max),
  how many answered, the wall time, sandboxes per second, and the daemon's CPU (dockerd plus
  containerd, CPU seconds over the burst's wall time). Ratios to sequential: throughput, and
  the burst's p50 and p99 over the sequential p50;
- kill -9: a child process (standing in for a rollout worker) starts a burst of ``--size`` with
  ``ttl_s=--ttl``, and is killed with SIGKILL once half its sandboxes exist. The janitor (the
  one a worker runs: ``sandbox.reap`` with the stack id) then runs every second; the bench
  reports how many containers the kill left, how many the janitor removed, and when the count
  of this burst's containers reached 0, against the TTL. Containers whose create was still in
  flight at the kill land after it; they are counted too (they carry the labels).

The bench runs under a stack id of its own (``CONVEYOR_STACK_ID=bench-burst-<hex>``), so its
janitor never sees another stack's sandboxes, and removes everything it made at the end,
whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("CONVEYOR_STACK_ID", "bench-burst-" + uuid.uuid4().hex[:8])

from services.rollout_worker.sandbox import DEFAULT_LIMITER, Sandbox, SandboxLabels, SandboxSpec, reap  # noqa: E402
from services.rollout_worker.sandbox.blocking import run_blocking  # noqa: E402
from services.rollout_worker.sandbox.client import default_client  # noqa: E402
from services.rollout_worker.sandbox.deployment import LABEL_RUN_ID  # noqa: E402
from services.rollout_worker.sandbox.images import build_busybox_image  # noqa: E402
from services.rollout_worker.sandbox.placement import SandboxTarget  # noqa: E402
from shared.stack_id import current_stack_id  # noqa: E402

DAEMONS = ("dockerd", "containerd")  # the shims come and go with containers: not counted


def spec_for(image: str, run_id: str, index: int, ttl_s: float | None = None) -> SandboxSpec:
    labels = SandboxLabels(run_id=run_id, group_id="burst", trajectory_id=f"{run_id}_{index}")
    return SandboxSpec(image=image, labels=labels, ttl_s=ttl_s)


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def daemon_cpu_s() -> float:
    total = 0.0
    for proc in psutil.process_iter(["name", "cpu_times"]):
        if proc.info["name"] in DAEMONS and proc.info["cpu_times"] is not None:
            total += proc.info["cpu_times"].user + proc.info["cpu_times"].system
    return total


async def first_command(image: str, run_id: str, index: int, ttl_s: float | None = None,
                        keep: list[Sandbox] | None = None, provider: SandboxTarget | None = None) -> float | None:
    """Seconds from the provision request to the first command's output; None if it failed. On
    ``provider`` (at its hosts' own limiters), else the local daemon at ``DEFAULT_LIMITER``."""
    started = time.perf_counter()
    limiter = DEFAULT_LIMITER if provider is None else None
    try:
        sandbox = await Sandbox.provision(spec_for(image, run_id, index, ttl_s), limiter=limiter, provider=provider)
    except Exception as exc:  # noqa: BLE001 - a failed provision is a figure, reported below
        print(f"  sandbox {index}: provision failed: {exc}", file=sys.stderr)
        return None
    try:
        result = await sandbox.exec("echo ready")
        elapsed = time.perf_counter() - started
        return elapsed if result.ok and result.output.strip() == "ready" else None
    finally:
        if keep is None:
            await sandbox.teardown()
        else:
            keep.append(sandbox)


async def sequential(image: str, run_id: str, n: int) -> tuple[list[float], float]:
    """One after the other, each kept (as in the burst), all torn down after the clock stops."""
    kept: list[Sandbox] = []
    started = time.perf_counter()
    times = [await first_command(image, run_id, i, keep=kept) for i in range(n)]
    rate = n / (time.perf_counter() - started)
    await asyncio.gather(*(s.teardown() for s in kept))
    return [t for t in times if t is not None], rate


async def burst(image: str, run_id: str, size: int) -> tuple[list[float], float, float]:
    """Every provision requested at once; all kept until the last answered, then torn down."""
    kept: list[Sandbox] = []
    cpu0, started = daemon_cpu_s(), time.perf_counter()
    times = await asyncio.gather(*(first_command(image, run_id, 10_000 + i, keep=kept) for i in range(size)))
    wall, cpu = time.perf_counter() - started, daemon_cpu_s() - cpu0
    await asyncio.gather(*(s.teardown() for s in kept))
    return [t for t in times if t is not None], wall, cpu


def containers_of(run_id: str) -> int:
    return len(default_client().api.containers(all=True, filters={"label": f"{LABEL_RUN_ID}={run_id}"}))


def killed_burst(image: str, size: int, ttl_s: float) -> None:
    """A stand-in worker in a child process, killed with SIGKILL halfway through its burst; then
    the janitor, every second, until none of the burst's containers is left."""
    run_id = "killed-" + uuid.uuid4().hex[:6]
    child = subprocess.Popen([sys.executable, __file__, "--child", run_id, "--size", str(size), "--ttl", str(ttl_s)],
                             env=os.environ.copy())
    deadline = time.time() + 300
    while containers_of(run_id) < size // 2:
        if child.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"the child burst never reached {size // 2} containers (exit {child.poll()})")
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    killed_at = time.time()
    child.wait()
    at_kill = containers_of(run_id)
    time.sleep(2)  # creates in flight at the kill land now
    orphans = containers_of(run_id)
    removed = 0
    client, stack_id = default_client(), current_stack_id()
    while (left := containers_of(run_id)) and time.time() < killed_at + ttl_s + 120:
        removed += len(reap(client, stack_id=stack_id))
        time.sleep(1)
    zero_after = time.time() - killed_at
    print(f"kill -9 halfway through a burst of {size} (ttl {ttl_s:.0f} s): {at_kill} containers at the kill, "
          f"{orphans} orphaned 2 s later; the janitor removed {removed}; {left} left, "
          f"{'0 reached' if not left else 'NOT cleared'} {zero_after:.1f} s after the kill "
          f"({zero_after / ttl_s:.2f}x the TTL)")


async def child_burst(image: str, run_id: str, size: int, ttl_s: float) -> None:
    kept: list[Sandbox] = []
    await asyncio.gather(*(first_command(image, run_id, i, ttl_s, keep=kept) for i in range(size)))
    await asyncio.sleep(3600)  # held until the parent kills this process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=256, help="sandboxes requested at once")
    parser.add_argument("--sequential", type=int, default=16, help="sandboxes one after the other, for the ratio")
    parser.add_argument("--ttl", type=float, default=20.0, help="the killed burst's sandbox TTL, seconds")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the stand-in worker's run id
    args = parser.parse_args()
    image = build_busybox_image()
    if args.child:
        asyncio.run(child_burst(image, args.child, args.size, args.ttl))
        return
    run_id = "burst-" + uuid.uuid4().hex[:6]
    try:
        print(f"stack {current_stack_id()}; {psutil.cpu_count()} cores; load {os.getloadavg()[0]:.2f}; "
              f"limiter: {DEFAULT_LIMITER.max_concurrent} creates in flight, {DEFAULT_LIMITER.min_interval_s * 1000:.0f} ms apart")
        asyncio.run(first_command(image, run_id, -1))  # warm the daemon's caches; not measured
        seq, seq_rate = asyncio.run(sequential(image, run_id, args.sequential))
        seq_p50 = statistics.median(seq)
        print(f"sequential ({args.sequential}): first command p50 {seq_p50 * 1000:.0f} ms, "
              f"p99 {percentile(seq, 0.99) * 1000:.0f} ms; {seq_rate:.1f} sandboxes/s")
        times, wall, cpu = asyncio.run(burst(image, run_id, args.size))
        rate = len(times) / wall
        p50, p99 = statistics.median(times), percentile(times, 0.99)
        print(f"burst ({args.size} at once): {len(times)}/{args.size} answered ({len(times) / args.size:.1%}); "
              f"first command p50 {p50:.2f} s, p99 {p99:.2f} s, max {max(times):.2f} s; wall {wall:.1f} s, "
              f"{rate:.1f} sandboxes/s; daemon CPU {cpu:.1f} s ({cpu / wall:.2f} cores)")
        print(f"ratios to sequential: throughput {rate / seq_rate:.2f}x; burst p50 {p50 / seq_p50:.1f}x and "
              f"p99 {p99 / seq_p50:.1f}x the sequential p50")
        print(f"load after the burst {os.getloadavg()[0]:.2f}")
        killed_burst(image, args.size, args.ttl)
    finally:
        removed = asyncio.run(run_blocking(lambda: reap(default_client(), stack_id=current_stack_id(),
                                                        is_terminal=lambda _tid: True)))
        if removed:
            print(f"cleanup: removed {len(removed)} containers of this bench's stack")


if __name__ == "__main__":
    main()
