"""A rollout task's finished trajectories are uploaded together (``services.rollout_worker.
upload_outbox``): the bundle goes out when the task's episodes have all ended, at its size limit,
or after its linger; and a worker that dies with a bundle unwritten loses nothing and duplicates
nothing: its members are still ``running`` under its lease, so they run again, and its late
write, should it come back, changes nothing. Real Redis, a real local store."""

from __future__ import annotations

import asyncio
import time

import pytest
from test_ledger import requests_for
from test_runner_failures import Harness, chat  # noqa: F401 (chat: the tokenizer fixture)

from services.rollout_worker.runner import upload_bundle
from services.rollout_worker.upload_outbox import UploadOutbox
from shared.state.leases import LeaseReaper, one_by_one
from shared.state.ledger import ROLLOUT
from shared.names import RedisKeys
from shared.schemas import ScoringTask, StopReason, Trajectory, parse_message
from shared.storage import get_model


def test_a_bundle_goes_out_when_the_tasks_episodes_end_at_its_size_limit_and_after_its_linger():
    bundles: list[list[str]] = []

    def upload(finished: list[str]) -> list[str]:
        bundles.append(finished)
        return [f"uploaded {name}" for name in finished]

    async def go() -> None:
        outbox = UploadOutbox(upload, ["a", "b", "c"], linger_s=60)
        waiting = [asyncio.create_task(outbox.hand_on(name, name)) for name in ("a", "b")]
        await asyncio.sleep(0.05)
        assert bundles == []  # c still runs
        outbox.finished("c")  # ... and ends without a trajectory to hand on: the task's episodes are done
        assert await asyncio.gather(*waiting) == ["uploaded a", "uploaded b"] and bundles == [["a", "b"]]

        bundles.clear()
        outbox = UploadOutbox(upload, [str(n) for n in range(5)], linger_s=60, max_bundle=2)
        assert len(await asyncio.gather(*(outbox.hand_on(str(n), str(n)) for n in range(5)))) == 5
        assert bundles == [["0", "1"], ["2", "3"], ["4"]]  # full, full, then the last episode ended

        bundles.clear()
        outbox = UploadOutbox(upload, ["a", "b"], linger_s=0.1)
        started = time.monotonic()
        assert await outbox.hand_on("a", "a") == "uploaded a"  # b runs on: the linger ran out
        assert bundles == [["a"]] and 0.1 <= time.monotonic() - started < 5
        outbox.finished("b")
        assert bundles == [["a"]]  # nothing left to upload

        bundles.clear()
        outbox = UploadOutbox(upload, ["a", "b"], linger_s=60, max_bundle=1)  # one object per trajectory, as before
        await asyncio.gather(outbox.hand_on("a", "a"), outbox.hand_on("b", "b"))
        assert bundles == [["a"], ["b"]]

    asyncio.run(go())


def test_every_member_of_a_bundle_that_could_not_be_written_gets_the_error():
    def upload(_finished: list[str]) -> list[str]:
        raise OSError("S3 server at 127.0.0.1:9 down past outage.limit_s")

    async def go() -> list[BaseException]:
        outbox = UploadOutbox(upload, ["a", "b"], linger_s=60)
        return await asyncio.gather(outbox.hand_on("a", "a"), outbox.hand_on("b", "b"), return_exceptions=True)

    errors = asyncio.run(go())
    assert [str(e) for e in errors] == ["S3 server at 127.0.0.1:9 down past outage.limit_s"] * 2


@pytest.fixture
def harness(ledger, store, chat, run_id):  # noqa: F811
    harness = Harness(ledger, store, chat, run_id)  # every trajectory an object (inline: test_inline_trajectories)
    harness.settings = harness.settings.model_copy(update={"ledger": harness.settings.ledger.model_copy(update={"inline_max_bytes": 0})})
    return harness


def test_a_worker_dead_with_its_bundle_unwritten_leaves_its_trajectories_to_run_again_once(harness, ledger, store, run_id):
    requests = requests_for(run_id, size=3)
    ledger.register(requests)
    tids = [r.trajectory_id for r in requests]
    dead = [ledger.claim(tid, f"dead{n:04d}", 0.3) for n, tid in enumerate(tids)]  # its heartbeat dies with it
    assert [claimed for claimed, _ in dead] == [True] * 3
    ctx = asyncio.run(harness.context())

    def finished(n: int, attempt: int, token: str) -> tuple[Trajectory, str]:
        return Trajectory(request=requests[n], turns=[], stop_reason=StopReason.done, attempt=attempt), token

    async def dies_before_its_bundle_goes_out() -> None:
        outbox = UploadOutbox(lambda f: upload_bundle(ctx, f), tids, linger_s=60)
        waiting = [asyncio.create_task(outbox.hand_on(tids[n], finished(n, 1, f"dead{n:04d}"))) for n in (0, 1)]
        await asyncio.sleep(0.05)  # two episodes done, the third still running: the bundle waits
        for task in waiting:
            task.cancel()  # the process is killed

    asyncio.run(dies_before_its_bundle_goes_out())
    assert store.list_keys("trajectories/") == []
    assert [ledger.state(tid) for tid in tids] == ["running"] * 3  # still this worker's, not lost

    time.sleep(0.4)  # its leases run out
    requeued: list[str] = []
    assert LeaseReaper(ledger, ROLLOUT, 3, 1.0, one_by_one(lambda tid, _payload: requeued.append(tid))).sweep() == {"requeued": 3, "resent": 0, "failed": 0}
    assert sorted(requeued) == sorted(tids)

    live = [ledger.claim(tid, f"live{n:04d}", 30) for n, tid in enumerate(tids)]  # another worker runs them again
    assert live == [(True, "2")] * 3
    outcomes = upload_bundle(ctx, [finished(n, 2, f"live{n:04d}") for n in range(3)])
    assert [str(result) for result, _ in outcomes] == ["uploaded"] * 3
    [winner] = store.list_keys("trajectories/")
    assert ".a2-live0000.bundle.json.gz" in winner

    late = upload_bundle(ctx, [finished(n, 1, f"dead{n:04d}") for n in range(3)])  # the dead worker was only frozen
    assert [(str(result), scoring) for result, scoring in late] == [("skipped:uploaded", None)] * 3
    assert winner in store.list_keys("trajectories/")  # its late object has a key of its own
    stored = [parse_message(ScoringTask, ledger.redis.hget(RedisKeys.scoring_tasks(run_id), tid)) for tid in tids]
    assert [task.trajectory_key for task in stored] == [f"{winner}#{n}" for n in range(3)]
    assert [get_model(store, task.trajectory_key, Trajectory).attempt for task in stored] == [2, 2, 2]
    assert ledger.counts(run_id)["uploaded"] == 3 and ledger.counts(run_id)["running"] == 0
