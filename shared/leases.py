"""Lease upkeep for any stage that holds work (``shared.ledger.LeaseStage``: rollout, scoring):
the keeper that claims and renews the leases of a worker process, and the reaper that
re-dispatches work whose lease ran out.

Invariants:
- A worker process renews all leases it holds for a stage in one Redis call per heartbeat; if
  the process dies, its leases stop being renewed and run out after ``lease_ttl_s``.
- The reaper only acts through ``Ledger.expire`` (atomic): any number of reapers may run, in
  any number of workers; a trajectory is re-dispatched or failed once per expiry.
- Right after Redis comes back (it restarted, or this process saw it down), a live holder has
  not renewed yet and every lease may look expired: the reaper takes none until Redis has
  been up for ``settle_s`` (a heartbeat plus the longest outage backoff), so an outage of
  Redis costs no attempt and no re-run, only the wait.
- After an outage of Redis (a restart, or this process saw it down), messages may have been
  lost with the connections (a delivery whose reply never arrived). Once settled, one reaper
  per stage and outage publishes again every trajectory waiting where the stage claims from
  with no lease on it, from its stored payload (rollout: the request stored at registration;
  scoring: the task stored when the rollout worker handed it on). Copies beyond the first are
  no-ops at the claim, so nothing runs twice and nothing waits for a message that is gone.
- A re-dispatched trajectory is published again at once with the payload stored at its claim
  (rollout: the request; scoring: the task's arguments). The claim makes every other copy
  (the loser of a race, or the broker's own redelivery after its visibility timeout) a no-op.
- A rollout task carries a group's members, and a worker claims them one by one. When a
  member's lease expires, members of its group that still wait in ``queued`` with no lease
  (received with it, never claimed before the worker died) are published again with it, so
  none of them waits for the broker's visibility timeout. What the broker alone still covers
  is a task whose worker died before claiming any member: milliseconds after delivery.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Callable

from shared.ledger import ROLLOUT, LeaseStage, Ledger
from shared.names import RedisKeys
from shared.outage import recoveries, seconds_since_recovery
from shared.settings import OutageSettings

log = logging.getLogger(__name__)

Redispatch = Callable[[str, str], None]  # (trajectory id, payload)


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
        lost = self.ledger.renew(held, self.lease_ttl_s, self.stage)
        if lost and self.on_lost is not None:
            self.on_lost(lost)
        return len(held) - len(lost)

    def start(self) -> None:
        if self._thread is None:
            self._thread = loop_thread(f"{self.stage.name}-lease-heartbeat", self.heartbeat_s, self.beat, self._stop)

    def stop(self) -> None:
        self._stop.set()


class Reaper:
    def __init__(self, ledger: Ledger, stage: LeaseStage, max_attempts: int, interval_s: float, redispatch: Redispatch,
                 settle_s: float = 0.0):
        self.ledger, self.stage, self.max_attempts, self.interval_s = ledger, stage, max_attempts, interval_s
        self.redispatch = redispatch
        self.settle_s = settle_s
        self._stop = threading.Event()
        self._outage_seen: tuple[str, int] | None = None  # at the first sweep

    def _outage_mark(self) -> tuple[str, int]:
        """Changes when Redis restarted (its run id) or this process saw it down and back."""
        return str(self.ledger.redis.info("server").get("run_id", "")), recoveries(self.ledger.redis)

    def settling(self) -> bool:
        """Redis came back less than ``settle_s`` ago: holders may not have renewed yet."""
        if self.settle_s <= 0:
            return False
        uptime = float(self.ledger.redis.info("server").get("uptime_in_seconds", "inf"))
        return min(uptime, seconds_since_recovery(self.ledger.redis)) < self.settle_s

    def sweep(self) -> dict[str, int]:
        outcome = {"requeued": 0, "failed": 0}
        mark = self._outage_mark()
        if self._outage_seen is None:
            self._outage_seen = mark
        if self.settling():
            return outcome
        if mark != self._outage_seen:
            self._outage_seen = mark
            self.resend_unclaimed()
        members_sent: set[str] = set()  # per sweep: a group's unclaimed members go out once
        for trajectory_id in self.ledger.expired_leases(stage=self.stage):
            result = self.ledger.expire(trajectory_id, self.max_attempts, stage=self.stage)
            if result == "requeued":
                payload = self.ledger.payload(trajectory_id, self.stage)
                self.redispatch(trajectory_id, payload)
                members_sent.add(trajectory_id)
                log.warning("%s lease of %s expired: re-dispatched", self.stage.name, trajectory_id)
            elif result == "failed":
                log.warning("%s lease of %s expired %d times: failed", self.stage.name, trajectory_id, self.max_attempts)
            if result in outcome:
                outcome[result] += 1
            if result in ("requeued", "failed") and self.stage is ROLLOUT:
                self._resend_group_members(trajectory_id, members_sent)
        return outcome

    def _resend_group_members(self, trajectory_id: str, already_sent: set[str]) -> int:
        """The message that carried an expired rollout lease carried its group's other members
        too; the worker holding it is presumed dead. Members it never claimed still wait in
        ``queued``, and only the broker's visibility timeout would bring their message back:
        publish them again now (a copy beyond the first is a no-op at the claim)."""
        try:
            request = self.ledger.request(trajectory_id)
        except KeyError:
            return 0
        members = {t: p for t, p in self.ledger.unclaimed_group_members(request).items() if t not in already_sent}
        for member, payload in members.items():
            self.redispatch(member, payload)
            already_sent.add(member)
        if members:
            log.warning("group %s of run %s: %d member(s) left unclaimed by the worker that held %s sent again",
                        request.group_id, request.run_id, len(members), trajectory_id)
        return len(members)

    def resend_unclaimed(self) -> int:
        """Publish again every trajectory waiting for this stage with no lease on it; one reaper
        of the fleet does it per outage (a lock that outlives the settling)."""
        if not self.ledger.redis.set(RedisKeys.resend_lock(self.stage.name), "1", nx=True, ex=int(max(30, 4 * self.settle_s))):
            return 0
        resent = 0
        for run_id in self.ledger.runs():
            for trajectory_id, payload in self.ledger.unclaimed(run_id, self.stage).items():
                self.redispatch(trajectory_id, payload)
                resent += 1
        if resent:
            log.warning("Redis was down: %d trajectories waiting for %s sent again (copies of a message that was not "
                        "lost are no-ops)", resent, self.stage.name)
        return resent

    def start(self) -> None:
        loop_thread(f"{self.stage.name}-lease-reaper", self.interval_s, self.sweep, self._stop)

    def stop(self) -> None:
        self._stop.set()


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
