"""ServedVersion: concurrent turns share Redis reads of the served policy version, and every turn
gets a value read after it asked (real Redis)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.rollout_worker.served_version import ServedVersion, read_fresh
from shared.redis_clients import redis_for
from shared.state.policy_version import PolicyVersion


def test_concurrent_turns_share_reads_and_each_sees_a_read_made_after_it_asked(redis_url):
    redis_client = redis_for(redis_url)
    served_key = PolicyVersion(redis_client, "sv-run")
    reads: list[int] = []
    gate = threading.Event()

    def read() -> int:
        version = served_key.get()
        gate.wait(5)  # the first read's reply is held until the turns below arrive
        reads.append(version)
        return version

    served = ServedVersion(read)

    async def scenario() -> list[int]:
        first = asyncio.ensure_future(served.fresh())
        await asyncio.sleep(0.05)  # the first read is under way
        served_key.advance(3)  # the version moves while it is: later turns must see 3
        later = [asyncio.ensure_future(served.fresh()) for _ in range(500)]
        await asyncio.sleep(0.05)
        gate.set()
        return [await first] + list(await asyncio.gather(*later))

    versions = asyncio.run(scenario())
    assert versions[0] == 0 and versions[1:] == [3] * 500  # none got the read that began before it asked
    assert len(reads) == 2  # 501 turns, two Redis reads
    assert asyncio.run(read_fresh(served)) == 3 and served() == 3


def test_a_failed_read_reaches_every_waiting_turn_and_the_next_read_runs():
    calls = []

    def read() -> int:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("redis down")
        return 7

    served = ServedVersion(read)

    async def scenario() -> int:
        with pytest.raises(ConnectionError):
            await served.fresh()
        return await served.fresh()

    assert asyncio.run(scenario()) == 7
