"""The limits hold, measured rather than read from the configuration: CPU time that the daemon
accounts to the container while a command tries to use more than its share, and the kernel's
own count of the periods in which it throttled the container."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.rollout_worker.sandbox import Limits, Sandbox

from security_support import spec_for

pytestmark = [pytest.mark.docker, pytest.mark.timeout(120)]

BURN_S = 3.0  # 30 CFS periods of 100 ms
BURNS = 4
BURN = f"for i in 1 2 3; do timeout {BURN_S} sh -c 'while :; do :; done' & done; wait"  # three busy loops


def cpu_stats(docker_client, container_id: str) -> tuple[float, int]:
    """(CPU seconds used, CFS periods throttled) as the daemon reports them for the container."""
    stats = docker_client.api.stats(container_id, stream=False)["cpu_stats"]
    return stats["cpu_usage"]["total_usage"] / 1e9, stats.get("throttling_data", {}).get("throttled_periods", 0)


def test_the_cpu_limit_is_enforced_not_only_configured(docker_client, busybox_image):
    async def burn() -> tuple[float, int]:
        """Burns until the kernel has throttled the container in 3 periods, at most ``BURNS`` times:
        a saturated host can leave the loops under their share for a whole burn."""
        async with await Sandbox.provision(spec_for(busybox_image, "cpu-half", limits=Limits(cpus=0.5))) as sandbox:
            (used0, throttled0), start = await asyncio.to_thread(cpu_stats, docker_client, sandbox.container_id), \
                time.monotonic()
            for _ in range(BURNS):
                result = await sandbox.exec(BURN, timeout_s=BURN_S + 10)
                assert result.exit_code is not None, result
                used1, throttled1 = await asyncio.to_thread(cpu_stats, docker_client, sandbox.container_id)
                if throttled1 - throttled0 >= 3:
                    break
            return (used1 - used0) / (time.monotonic() - start), throttled1 - throttled0

    cores, throttled = asyncio.run(burn())
    assert cores <= 0.5 * 1.25, cores  # the CFS quota held against three runnable loops
    # because the kernel throttled the container, period after period: nearly every period on a
    # quiet host; a host that is itself saturated leaves the loops less than their share, and fewer
    assert throttled >= 3, throttled
    assert cores >= 0.5 * 0.3, cores  # and the loops really ran (the measurement sees them)
