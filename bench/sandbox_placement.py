"""Placement under a burst (issue 31, item 4): sandboxes requested at once on one host, and on two
hosts through ``placement.HostPlacement`` (the local daemon and a second dockerd in a network
namespace over mutual TLS, ``tests/remote_docker_support.py``; needs root).

    .venv/bin/python bench/sandbox_placement.py [--size 64] [--rounds 2]

Each round runs three setups, one after the other, each a fresh placement with ``--size``
provisions requested in the same instant (``sandbox_burst.first_command``: provision request to
the first command's output), every sandbox kept until the last answered: the local daemon alone,
the namespaced one alone, then both. Per setup it prints how many sandboxes answered, the time to
first command (p50, p99, max) over all and per host, the wall time, and per host: sandboxes placed,
the peak of this worker's sandboxes there (``PlacedHost.peak_load``) and the peak of creates in
flight (its rate limiter). The two-host line ends with its p50/p99 over the local-only ones.

Both daemons run on this machine: the second host adds a daemon, not cores. The busybox image is
shipped to the namespaced daemon before the first round, so both hosts hold it. Everything this
bench made is removed at the end, on both hosts.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from sandbox_burst import first_command, percentile  # noqa: E402  (sets this bench's stack id)
from remote_docker_support import remote_docker_host  # noqa: E402

from services.rollout_worker.sandbox import Sandbox, reap  # noqa: E402
from services.rollout_worker.sandbox import providers  # noqa: E402
from services.rollout_worker.sandbox.docker_provider import DockerProvider  # noqa: E402
from services.rollout_worker.sandbox.images import build_busybox_image, ship_image  # noqa: E402
from services.rollout_worker.sandbox.placement import HostPlacement, PlacedHost  # noqa: E402
from shared.settings.sandbox import DockerProviderSettings  # noqa: E402
from shared.stack_id import current_stack_id  # noqa: E402


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def spread(times: list[float]) -> str:
    if not times:
        return "none answered"
    return f"p50 {ms(statistics.median(times))}, p99 {ms(percentile(times, 0.99))}, max {ms(max(times))}"


async def placed_burst(placement: HostPlacement, image: str, run_id: str, size: int
                       ) -> tuple[list[tuple[float, PlacedHost]], float]:
    """(time to first command, host) of each sandbox that answered, and the wall time."""
    for host in placement.hosts:
        host.limiter.peak_in_flight = 0
    kept: list[list[Sandbox]] = [[] for _ in range(size)]
    started = time.perf_counter()
    times = await asyncio.gather(*(first_command(image, run_id, i, keep=kept[i], provider=placement)
                                   for i in range(size)))
    wall = time.perf_counter() - started
    answered = [(t, mine[0].provider) for t, mine in zip(times, kept) if t is not None and mine]
    await asyncio.gather(*(s.teardown() for mine in kept for s in mine))
    return [(t, host) for t, host in answered if isinstance(host, PlacedHost)], wall


def report(name: str, placement: HostPlacement, names: dict[int, str], results: list[tuple[float, PlacedHost]],
           wall: float, size: int) -> list[float]:
    times = [t for t, _ in results]
    print(f"{name}: {len(times)}/{size} answered; first command {spread(times)}; wall {wall:.2f} s")
    for host in placement.hosts:
        mine = [t for t, h in results if h is host]
        print(f"    {names[id(host.provider)]}: {host.placed} placed, peak {host.peak_load} held, "
              f"peak {host.limiter.peak_in_flight} creates in flight; first command {spread(mine)}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=64, help="sandboxes requested at once")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    image = build_busybox_image()
    run_id = "placement-" + uuid.uuid4().hex[:6]
    with remote_docker_host() as remote:
        local, far = providers.docker_provider(DockerProviderSettings()), providers.docker_provider(remote.settings)
        names = {id(local): "local", id(far): "namespaced"}
        ship_image(image, source=local.client, target=far.client)
        setups: dict[str, list[DockerProvider]] = {"one host (local)": [local], "one host (namespaced)": [far],
                                                   "two hosts": [local, far]}
        try:
            warm = HostPlacement([local, far], max_sandboxes_per_host=1, recheck_s=5)
            asyncio.run(placed_burst(warm, image, run_id, 2))  # one on each host; not measured
            for round_ in range(args.rounds):
                print(f"-- round {round_ + 1}: {args.size} at once")
                figures: dict[str, list[float]] = {}
                for name, hosts in setups.items():
                    placement = HostPlacement(hosts, max_sandboxes_per_host=args.size, recheck_s=5)
                    results, wall = asyncio.run(placed_burst(placement, image, run_id, args.size))
                    figures[name] = report(name, placement, names, results, wall, args.size)
                one, two = figures["one host (local)"], figures["two hosts"]
                if one and two:
                    print(f"two hosts over the local one alone: p50 {statistics.median(two) / statistics.median(one):.2f}x, "
                          f"p99 {percentile(two, 0.99) / percentile(one, 0.99):.2f}x")
        finally:
            removed = sum(len(reap(p, stack_id=current_stack_id(), is_terminal=lambda _tid: True)) for p in (local, far))
            if removed:
                print(f"cleanup: removed {removed} containers of this bench's stack")


if __name__ == "__main__":
    main()
