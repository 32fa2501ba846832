"""Lease upkeep for any stage that holds work (``shared.state.ledger.LeaseStage``: rollout, scoring):
the keeper that claims and renews the leases of a worker process, and the reaper that
re-dispatches work whose lease ran out.

Invariants:
- A worker process renews all leases it holds for a stage in one Redis call per heartbeat; if
  the process dies, its leases stop being renewed and run out after ``lease_ttl_s``.
- A sweep visits every run in the run registry (``RedisKeys.runs``): each run's lease zset is
  its own, under the run's hash tag, so a Redis Cluster keeps each expiry in one slot.
  Whether the stage's broker queue holds messages is read once per sweep (the broker's Redis
  need not be the ledger's).
- The reaper only acts through ``Ledger.expire`` (atomic): any number of reapers may run, in
  any number of workers; a trajectory is re-dispatched or failed once per expiry.
- Right after Redis comes back (it restarted, or this process saw it down), a live holder has
  not renewed yet and every lease may look expired: the reaper takes none until Redis has
  been up for ``settle_s`` (a heartbeat plus the longest outage backoff), so an outage of
  Redis costs no attempt and no re-run, only the wait.
- A lease last renewed before the Redis server now answering started was lost in a crash of
  Redis (with its holders, when a machine or a whole stack went down), not by anything its
  trajectory did: it is re-dispatched without counting the attempt. A trajectory fails
  ``lease_expired`` only for holders that died while Redis stayed up (``max_attempts`` of them),
  so crashes of everything never fail work, however many.
- Nothing is sent again merely because Redis was down: a message lost with it (a delivery whose
  reply never arrived, the last second of writes before a crash) is found by its dispatch
  deadline, which every state that waits for a stage holds (``shared.state.ledger``). So a broker
  restart multiplies no task: only trajectories still unclaimed past their deadline go out
  again, and only once their stage's broker queue is empty (a message still waiting there is
  not copied: an outage stalls every worker, and every waiting deadline passes).
- A re-dispatched trajectory is published again at once with the payload stored for it
  (rollout: the request; scoring: the task's arguments). The claim makes every other copy
  (the loser of a race, or the broker's own redelivery after its visibility timeout) a no-op.
- What one sweep sends again goes to ``redispatch`` in one call: the rollout worker publishes
  one task per GRPO group of it, not one per trajectory.
- A rollout task carries a group's members, and a worker claims them one by one. When a
  member's lease expires, members of its group that still wait in ``queued`` with no lease
  (received with it, never claimed before the worker died) are published again with it, before
  their own dispatch deadlines. A task whose worker died before claiming any member, or that
  the broker lost (it takes a message off its queue before it records the delivery), goes out
  again at its members' dispatch deadlines: never only the broker's to recover.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Callable

from shared.prometheus import LEASE_RENEWAL_SECONDS
from shared.state.ledger import ROLLOUT, LeaseStage, Ledger
from shared.settings import OutageSettings

log = logging.getLogger(__name__)

Redispatch = Callable[[list[tuple[str, str]]], object]  # [(trajectory id, payload)] to publish again, in order


def one_by_one(publish: Callable[[str, str], object]) -> Redispatch:
    """A ``Redispatch`` that publishes each (trajectory id, payload) alone."""
    def redispatch(items: list[tuple[str, str]]) -> None:
        for trajectory_id, payload in items:
            publish(trajectory_id, payload)

    return redispatch


class LeaseKeeper:
    def __init__(self, ledger: Ledger, lease_ttl_s: float, heartbeat_s: float, stage: LeaseStage = ROLLOUT,
                 on_lost: Callable[[list[str]], None] | None = None):
        """``on_lost``: told, from the heartbeat thread, of held trajectories whose lease is no
        longer this holder's (failed as superseded, or expired and claimed elsewhere)."""
        self.ledger, self.lease_ttl_s, self.heartbeat_s, self.stage = ledger, lease_ttl_s, heartbeat_s, stage
        self.on_lost = on_lost
        self._held: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def claim(self, trajectory_id: str, payload: str = "") -> tuple[str | None, str]:
        """Claim the stage's lease under a fresh token and keep it renewed until ``release``.
        Returns (token, attempt) or (None, the state that blocked the claim)."""
        return self.claim_many([(trajectory_id, payload)])[0]

    def claim_many(self, claims: list[tuple[str, str]]) -> list[tuple[str | None, str]]:
        """``claim`` for each (trajectory id, payload), in one round trip to Redis."""
        tokens = [uuid.uuid4().hex for _ in claims]
        results = self.ledger.claim_many([(tid, token, payload) for (tid, payload), token in zip(claims, tokens)],
                                         self.lease_ttl_s, self.stage)
        out: list[tuple[str | None, str]] = []
        for (tid, _payload), token, (claimed, detail) in zip(claims, tokens, results):
            if claimed:
                self.hold(tid, token)
            out.append((token if claimed else None, detail))
        return out

    def hold(self, trajectory_id: str, token: str) -> None:
        with self._lock:
            self._held[trajectory_id] = token

    def release(self, trajectory_id: str) -> None:
        with self._lock:
            self._held.pop(trajectory_id, None)

    def beat(self) -> int:
        with self._lock:
            held = dict(self._held)
        if not held:
            return 0
        started = time.monotonic()
        lost = self.ledger.renew(held, self.lease_ttl_s, self.stage)
        LEASE_RENEWAL_SECONDS.labels(self.stage.name).observe(time.monotonic() - started)
        if lost and self.on_lost is not None:
            self.on_lost(lost)
        return len(held) - len(lost)

    def start(self) -> None:
        if self._thread is None:
            self._thread = loop_thread(f"{self.stage.name}-lease-heartbeat", self.heartbeat_s, self.beat, self._stop)

    def stop(self) -> None:
        self._stop.set()


class LeaseReaper:
    def __init__(self, ledger: Ledger, stage: LeaseStage, max_attempts: int, interval_s: float, redispatch: Redispatch,
                 settle_s: float = 0.0, lease_ttl_s: float = 0.0):
        """``lease_ttl_s`` (the holders' TTL): a lease last renewed before Redis restarted is
        expired without counting its attempt (0: every expiry counts)."""
        self.ledger, self.stage, self.max_attempts, self.interval_s = ledger, stage, max_attempts, interval_s
        self.redispatch = redispatch
        self.settle_s = settle_s
        self.lease_ttl_s = lease_ttl_s
        self._stop = threading.Event()

    def settling(self, uptime_s: float | None = None) -> bool:
        """Redis came back less than ``settle_s`` ago: holders may not have renewed yet."""
        if self.settle_s <= 0:
            return False
        uptime = self.ledger.server_uptime_s() if uptime_s is None else uptime_s
        return min(uptime, self.ledger.seconds_since_recovery()) < self.settle_s

    def _forgive_before(self, uptime_s: float) -> float:
        """Leases with an earlier deadline were last renewed before this Redis server started
        (one second of slack for its whole-second uptime): their attempts do not count."""
        if not self.lease_ttl_s or uptime_s == float("inf"):
            return 0.0
        return time.time() - uptime_s + 1.0 + self.lease_ttl_s

    def sweep(self) -> dict[str, int]:
        """One pass over the stage's passed deadlines: ``requeued`` (a lease ran out), ``resent``
        (a trajectory waited unclaimed past its dispatch deadline) and ``failed``. What goes out
        again is published in one ``redispatch`` call, in the order found."""
        outcome = {"requeued": 0, "resent": 0, "failed": 0}
        uptime = self.ledger.server_uptime_s()  # one INFO per sweep, for both uses
        if self.settling(uptime):
            return outcome
        to_send: dict[str, str] = {}  # per sweep: each trajectory goes out once
        waiting = 0
        forgive_before = self._forgive_before(uptime)
        expired = self.ledger.expired_leases(stage=self.stage)
        queue_busy = bool(expired) and self.ledger.queue_busy(self.stage)  # one LLEN per sweep, on the broker's Redis
        for trajectory_id in expired:
            result = self.ledger.expire(trajectory_id, self.max_attempts, stage=self.stage, forgive_before=forgive_before,
                                        queue_busy=queue_busy)
            waiting += result == "waiting"
            if result in ("requeued", "resent"):
                self._add_payload(trajectory_id, to_send)
                log.warning("%s of %s: %s", self.stage.name, trajectory_id, _SAID[result])
            elif result == "failed":
                log.warning("%s lease of %s expired %d times: failed", self.stage.name, trajectory_id, self.max_attempts)
            if result in outcome:
                outcome[result] += 1
            if result in ("requeued", "failed") and self.stage is ROLLOUT:
                self._add_group_members(trajectory_id, to_send)
        if waiting:
            log.info("%s: %d trajector%s past the dispatch deadline, not sent again: queue %r still holds messages",
                     self.stage.name, waiting, "y" if waiting == 1 else "ies", self.stage.queue)
        if to_send:
            self.redispatch(list(to_send.items()))
        return outcome

    def _add_payload(self, trajectory_id: str, to_send: dict[str, str]) -> None:
        try:
            to_send[trajectory_id] = self.ledger.payload(trajectory_id, self.stage)
        except KeyError as exc:  # registered without one (never by intake or the upload): nothing to send
            log.error("%s of %s cannot go out again: %s", self.stage.name, trajectory_id, exc)

    def _add_group_members(self, trajectory_id: str, to_send: dict[str, str]) -> int:
        """The message that carried an expired rollout lease carried its group's other members
        too; the worker holding it is presumed dead. Members it never claimed still wait in
        ``queued``: they go out again now, with it, instead of at their dispatch deadline (a
        copy beyond the first is a no-op at the claim)."""
        try:
            request = self.ledger.request(trajectory_id)
        except KeyError:
            return 0
        members = {t: p for t, p in self.ledger.unclaimed_group_members(request).items() if t not in to_send}
        to_send.update(members)
        if members:
            log.warning("group %s of run %s: %d member(s) left unclaimed by the worker that held %s sent again",
                        request.group_id, request.run_id, len(members), trajectory_id)
        return len(members)

    def start(self) -> None:
        loop_thread(f"{self.stage.name}-lease-reaper", self.interval_s, self.sweep, self._stop)

    def stop(self) -> None:
        self._stop.set()


_SAID = {"requeued": "lease expired: re-dispatched", "resent": "unclaimed past its dispatch deadline: sent again"}


def settle_s(heartbeat_s: float, outage: OutageSettings) -> float:
    """How long after Redis came back a reaper waits: every live holder renews by then."""
    return heartbeat_s + outage.backoff_max_s + 1.0


def loop_thread(name: str, interval_s: float, fn: Callable[[], object], stop: threading.Event) -> threading.Thread:
    def loop() -> None:
        while not stop.wait(interval_s):
            try:
                fn()
            except Exception:  # an outage is waited out below this; anything else: next tick, never kill the thread
                log.exception("%s tick failed", name)

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    return thread
