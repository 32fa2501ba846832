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


def test_at_least_waits_for_the_announced_version_sharing_one_wait(redis_url):
    """Episodes admitted before their weights were served wait for that version; the advance's
    announcement wakes them at once (not at the poll), and the subscription is closed after."""
    from shared.state.admission_wake import AdmissionWake

    redis_client = redis_for(redis_url)
    version = PolicyVersion(redis_client, "sv-gate")
    reads: list[int] = []

    def read() -> int:
        reads.append(1)
        return version.get()

    wake = AdmissionWake(redis_client, "sv-gate")
    served = ServedVersion(read, wake)

    async def scenario() -> tuple[list[int], float]:
        waiting = [asyncio.ensure_future(served.at_least(2)) for _ in range(50)]
        await asyncio.sleep(0.3)  # more than one poll: still waiting, version 0 then 1 are not enough
        version.advance(1)
        await asyncio.sleep(0.1)
        assert not any(w.done() for w in waiting)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        version.advance(2)  # announces on the run's admission channel
        results = await asyncio.gather(*waiting)
        return list(results), loop.time() - t0

    results, woke_after = asyncio.run(scenario())
    assert results == [2] * 50
    assert woke_after < 0.15  # the announcement, not the 0.2 s poll
    assert len(reads) < 20  # 50 waiters share the reads
    assert wake._pubsub is None  # closed once the last waiter was through
    assert asyncio.run(served.at_least(1)) == 2  # served already: no wait


def test_at_least_without_announcements_polls():
    values = iter([0, 0, 5])
    served = ServedVersion(lambda: next(values))
    assert asyncio.run(served.at_least(5)) == 5


def test_a_long_wait_for_a_version_is_logged_and_ends_when_it_is_served(monkeypatch, caplog):
    import logging
    import types

    from services.rollout_worker import runner

    monkeypatch.setattr(runner, "VERSION_WAIT_LOG_S", 0.1)
    version = {"served": 1}
    served = ServedVersion(lambda: version["served"])
    request = types.SimpleNamespace(trajectory_id="run/0/0", generate_from_version=2)

    async def scenario() -> None:
        waiting = asyncio.ensure_future(runner._wait_for_version(served, request))
        await asyncio.sleep(0.35)
        assert not waiting.done()
        version["served"] = 2
        await asyncio.wait_for(waiting, 1)

    with caplog.at_level(logging.WARNING, logger=runner.__name__):
        asyncio.run(scenario())
    lines = [r.getMessage() for r in caplog.records if "waits" in r.getMessage()]
    assert lines and "policy version 2" in lines[0] and "served now: 1" in lines[0], lines
