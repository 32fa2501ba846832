"""runc against gVisor's runsc on one daemon, in one run: cold start, session round trip and a
CPU-heavy command, as ratios (issue 31, item 3).

    .venv/bin/python bench/sandbox_runtimes.py [--rounds 3] [--cold 4] [--commands 200]

Needs root and runsc (Debian's package): the daemon is the namespaced second dockerd of
``tests/remote_docker_support.py``, which has runsc registered (the host daemon is left alone).
Both runtimes run on that daemon; the rounds alternate runc and runsc so that the machine's load
falls on both alike. Sandboxes use the persistent session (``session: true``, the default), so
the round trip is the session's under each runtime (runsc's has no worker shell: one privilege
drop per command, see ``protocol``). Reuses ``bench/sandbox.py``'s samplers.

- cold start: from the provision request to the first command's output;
- round trip: ``true`` through the session, p50 over ``--commands``;
- CPU-heavy: ``sha256sum`` of 100 MB from /dev/zero, then a 200,000-step shell loop (system
  calls and pure computation), wall time of the command.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

import docker  # noqa: E402
from remote_docker_support import remote_docker_host  # noqa: E402
from sandbox import RUN_ID, quantiles, round_trips, spec_for  # noqa: E402

from services.rollout_worker.sandbox import Sandbox, providers  # noqa: E402
from services.rollout_worker.sandbox.images import build_busybox_image, ship_image  # noqa: E402

RUNTIMES = ("runc", "runsc")
CPU_HEAVY = "head -c 100000000 /dev/zero | sha256sum >/dev/null; i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done; echo $i"


async def one_round(image: str, provider, args) -> dict[str, list[float]]:
    cold: list[float] = []
    for i in range(args.cold):
        start = time.perf_counter()
        async with await Sandbox.provision(spec_for(image, i), provider=provider) as sandbox:
            assert (await sandbox.exec("echo ready")).output == "ready\n"
            cold.append(time.perf_counter() - start)
    async with await Sandbox.provision(spec_for(image, 900), provider=provider) as sandbox:
        await round_trips(sandbox, 20)
        trips = await round_trips(sandbox, args.commands)
        start = time.perf_counter()
        result = await sandbox.exec(CPU_HEAVY, timeout_s=120)
        cpu = [time.perf_counter() - start]
        assert result.output.strip() == "200000", result
    return {"cold start": cold, "round trip": trips, "CPU-heavy": cpu}


async def main(args: argparse.Namespace) -> None:
    image = build_busybox_image()
    with remote_docker_host(runtime="runsc") as host:
        by_runtime = {rt: providers.provider_from(host.settings.model_copy(update={"runtime": rt})) for rt in RUNTIMES}
        ship_image(image, source=docker.from_env(), target=by_runtime["runc"].client)
        samples: dict[str, dict[str, list[float]]] = {rt: {} for rt in RUNTIMES}
        for rt in RUNTIMES:  # warm both runtimes' caches; not measured
            await one_round(image, by_runtime[rt], argparse.Namespace(cold=1, commands=5))
        for _ in range(args.rounds):
            for rt in RUNTIMES:
                for name, values in (await one_round(image, by_runtime[rt], args)).items():
                    samples[rt].setdefault(name, []).extend(values)
    print(f"runc vs runsc on one namespaced daemon, {args.rounds} alternating rounds, run={RUN_ID}")
    for name in samples["runc"]:
        p50 = {rt: statistics.median(samples[rt][name]) * 1e3 for rt in RUNTIMES}
        p95 = {rt: quantiles(samples[rt][name])[1] * 1e3 for rt in RUNTIMES}
        print(f"  {name:<11} runc p50 {p50['runc']:9.2f} ms (p95 {p95['runc']:9.2f})   runsc p50 {p50['runsc']:9.2f} ms "
              f"(p95 {p95['runsc']:9.2f})   ratio {p50['runsc'] / p50['runc']:5.2f}   n={len(samples['runc'][name])}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cold", type=int, default=4, help="cold starts per runtime per round")
    parser.add_argument("--commands", type=int, default=200, help="round trips per runtime per round")
    asyncio.run(main(parser.parse_args()))
