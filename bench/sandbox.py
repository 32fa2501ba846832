"""Sandbox benchmark: cold start, command round trip (session vs docker exec), provisioning rate,
and the coding grader's cost per verdict in a clean sandbox.

    .venv/bin/python bench/sandbox.py [--cold 20] [--commands 1000] [--execs 100] [--verdicts 20]
    .venv/bin/python bench/sandbox.py --verdicts 20 --only-verdicts

Measures on the local daemon (or DOCKER_HOST), with the busybox image built offline:
- first command: time from the provision request to the first command's output, cold;
- round trip p50/p95 of a trivial command through the persistent session, through one
  ``docker exec`` per command (our fallback), and through the SDK's ``exec_run`` for reference;
- provisions per second at 16 concurrent (each provisioned, answers one command, torn down),
  and a burst of 64 simultaneous provisions through the default rate limiter.
- time per verdict (``CodingEnv.verify``: the final diff, the static scan, a fresh sandbox of the
  Python image, the diff and the hidden test applied, the trusted runner, teardown) for a small
  fixture repository (two tests), with the fix as the agent's diff.
Issue targets: first command p50 <= 300 ms cold; round trip p50 <= 2 ms through the session;
a verdict p50 < 1 s for the small fixture.
Every container is labelled with this run's id and removed at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.rollout_worker.sandbox import (  # noqa: E402
    WarmPool,
    ProvisionLimiter,
    Sandbox,
    SandboxLabels,
    SandboxSpec,
    reap,
)
from services.rollout_worker.sandbox.blocking import run_blocking  # noqa: E402
from services.rollout_worker.sandbox.client import default_client  # noqa: E402
from services.rollout_worker.sandbox.images import build_busybox_image  # noqa: E402
from shared.stack_id import current_stack_id  # noqa: E402

RUN_ID = "bench-" + uuid.uuid4().hex[:8]


def spec_for(image: str, index: int, **overrides) -> SandboxSpec:
    labels = SandboxLabels(run_id=RUN_ID, group_id="bench", trajectory_id=f"{RUN_ID}_{index}")
    return SandboxSpec(image=image, labels=labels, **overrides)


def quantiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]


def row(name: str, samples: list[float], unit: str = "ms", target: str = "") -> None:
    p50, p95 = quantiles(samples)
    scale = 1e3 if unit == "ms" else 1.0
    print(f"  {name:<44} p50 {p50 * scale:8.2f} {unit}   p95 {p95 * scale:8.2f} {unit}   n={len(samples):<5} {target}")


async def first_command(image: str, n: int) -> list[float]:
    samples = []
    for i in range(n):
        start = time.perf_counter()
        async with await Sandbox.provision(spec_for(image, i)) as sandbox:
            result = await sandbox.exec("echo ready")
            samples.append(time.perf_counter() - start)
            assert result.output == "ready\n", result
    return samples


async def warm_first_command(image: str, n: int) -> list[float]:
    """From acquire to first output, with the pool refilled between samples (a steady state
    in which refills keep up with demand)."""
    samples = []
    async with WarmPool(spec_for(image, 500), size=2) as pool:
        for i in range(n):
            while pool.idle < 2:
                await asyncio.sleep(0.01)
            start = time.perf_counter()
            sandbox = await pool.acquire(run_id=RUN_ID, group_id="0", trajectory_id=f"warm-{i}")
            result = await sandbox.exec("echo ready")
            samples.append(time.perf_counter() - start)
            assert result.output == "ready\n", result
            await sandbox.teardown()
    return samples


async def round_trips(sandbox: Sandbox, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        result = await sandbox.exec("true")
        samples.append(time.perf_counter() - start)
        assert result.exit_code == 0, result
    return samples


async def sdk_exec_run(sandbox: Sandbox, n: int) -> list[float]:
    container = default_client().containers.get(sandbox.container_id)
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        exit_code, _ = await run_blocking(container.exec_run, ["true"], user="65534:65534")
        samples.append(time.perf_counter() - start)
        assert exit_code == 0
    return samples


async def provision_rate(image: str, total: int, concurrency: int,
                         limiter: ProvisionLimiter) -> tuple[float, list[float]]:
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(index: int) -> None:
        async with gate:
            start = time.perf_counter()
            async with await Sandbox.provision(spec_for(image, 1000 + index), limiter=limiter) as sandbox:
                await sandbox.exec("true")
                latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(total)))
    return total / (time.perf_counter() - start), latencies


async def burst(image: str, size: int, limiter: ProvisionLimiter) -> tuple[float, int]:
    start = time.perf_counter()
    results = await asyncio.gather(*(Sandbox.provision(spec_for(image, 5000 + i), limiter=limiter)
                                     for i in range(size)), return_exceptions=True)
    elapsed = time.perf_counter() - start
    sandboxes = [r for r in results if isinstance(r, Sandbox)]
    answered = sum([(await s.exec("echo ok")).ok for s in sandboxes])
    await asyncio.gather(*(s.teardown() for s in sandboxes))
    return elapsed, answered


SHOP = "def total(prices):\n    return sum(prices) - 1\n\n\ndef discount(price, percent):\n    return price * (100 - percent) / 100\n"
SHOP_TESTS = {"tests/test_discount.py": "from shop import discount\n\n\ndef test_discount():\n    assert discount(200, 10) == 180\n"}
HIDDEN = "from shop import total\n\n\ndef test_total():\n    assert total([1, 2, 3]) == 6\n"


def shop_task(root: Path) -> dict:
    """A git repository whose hidden test fails until ``total`` is fixed (the red team's fixture)."""
    import json
    import subprocess

    from services.rollout_worker.environments.coding import coding_task

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.email=b@b", "-c", "user.name=b", *args], cwd=root, check=True,
                              capture_output=True, text=True).stdout
    for rel, text in {"shop/__init__.py": SHOP, **SHOP_TESTS}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    git("init", "-q", "-b", "main")
    git("add", "-A")
    git("commit", "-qm", "shop")
    base = git("rev-parse", "HEAD").strip()
    (root / "tests/test_total.py").write_text(HIDDEN)
    git("add", "-N", "tests/test_total.py")
    test_patch = git("diff", "--", "tests/test_total.py")
    (root / "tests/test_total.py").unlink()
    return coding_task({"instance_id": "shop-1", "repo": "shop/shop", "repo_url": f"file://{root}",
                        "base_commit": base, "problem_statement": "total() is off by one.", "test_patch": test_patch,
                        "FAIL_TO_PASS": json.dumps(["tests/test_total.py::test_total"]),
                        "PASS_TO_PASS": json.dumps(["tests/test_discount.py::test_discount"])})


async def verdicts(n: int) -> tuple[list[float], list[float]]:
    """Seconds per ``verify`` (clean-sandbox grading) of an episode that fixed the bug, and of the
    test run inside it (the trusted runner, as the root shell timed it)."""
    import tempfile

    from services.rollout_worker.environments.coding import CodingEnv
    from services.rollout_worker.environments.coding.images import build_python_image
    from shared.environments import AgentAction
    from shared.schemas import ToolCall

    image = await run_blocking(build_python_image)
    samples, runs = [], []
    with tempfile.TemporaryDirectory(prefix="bench-grading-") as tmp:
        task = shop_task(Path(tmp) / "repo")
        fix = ToolCall(name="write_file", arguments={"path": "shop/__init__.py", "content": SHOP.replace(" - 1", "")})
        for i in range(n + 1):
            env = CodingEnv({"image": image, "workspace_cache_dir": str(Path(tmp) / "cache")})
            env.bind_trajectory(run_id=RUN_ID, group_id="bench", trajectory_id=f"{RUN_ID}_verdict_{i}")
            try:
                await env.reset(task, seed=0)
                await env.step(AgentAction("", [fix], None))
                start = time.perf_counter()
                verdict = await env.verify()
                if i:  # the first verdict warms the image and the daemon; not measured
                    samples.append(time.perf_counter() - start)
                    runs.append(verdict.info["tests_duration_s"])
                assert verdict.reward == 1.0, verdict.info
            finally:
                await env.close()
    return samples, runs


async def main(args: argparse.Namespace) -> None:
    if args.verdicts:
        print("coding grader, clean sandbox per verdict (fixture: 2 tests, the fix as the diff):")
        samples, runs = await verdicts(args.verdicts)
        row("verify (diff, scan, fresh sandbox, tests, teardown)", samples, target="(target p50 < 1000 ms)")
        row("of which the test run (trusted runner)", runs)
    if args.only_verdicts:
        return
    image = await run_blocking(build_busybox_image)
    print(f"sandbox benchmark  image={image}  run={RUN_ID}")

    await first_command(image, 2)  # warm the daemon's caches; not measured
    cold = await first_command(image, args.cold)
    print("first command output, from the provision request:")
    row("cold (create + attach + start + shell)", cold, target="(target p50 <= 300 ms)")
    row("warm pool (acquire + first command)", await warm_first_command(image, args.cold), target="(target p50 <= 30 ms)")

    print("command round trip (`true`):")
    async with await Sandbox.provision(spec_for(image, 900)) as session_box:
        await round_trips(session_box, 50)
        row("persistent session (attached socket)", await round_trips(session_box, args.commands),
            target="(target p50 <= 2 ms)")
        row("SDK container.exec_run (reference)", await sdk_exec_run(session_box, args.execs))
    async with await Sandbox.provision(spec_for(image, 901, session=False)) as exec_box:
        row("docker exec per command (our fallback)", await round_trips(exec_box, args.execs))

    limiter = ProvisionLimiter(max_concurrent=8, min_interval_s=0.01)
    rate, latencies = await provision_rate(image, args.rate_total, 16, limiter)
    print(f"provisioning at 16 concurrent ({args.rate_total} sandboxes, limiter 8 in flight):")
    print(f"  {rate:.1f} provisions/s (provision + first command + teardown)")
    row("provision request -> first output, under load", latencies)
    elapsed, answered = await burst(image, 64, ProvisionLimiter())
    print(f"burst of 64 simultaneous provisions (default limiter): {answered}/64 answered, "
          f"all ready after {elapsed:.2f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold", type=int, default=20)
    parser.add_argument("--commands", type=int, default=1000)
    parser.add_argument("--execs", type=int, default=100)
    parser.add_argument("--rate-total", type=int, default=48)
    parser.add_argument("--verdicts", type=int, default=20, help="verdicts to time (0: skip)")
    parser.add_argument("--only-verdicts", action="store_true", help="only the grading cost")
    try:
        asyncio.run(main(parser.parse_args()))
    finally:
        leaked = reap(default_client(), stack_id=current_stack_id(), run_id=RUN_ID, now=float("inf"))
        if leaked:
            print(f"removed {len(leaked)} containers left by this run", file=sys.stderr)
