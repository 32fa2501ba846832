"""Wake-ups for intake's admission wait: the staleness bound's writers say when it may have
moved, so a waiting intake tries again at once instead of at its next poll.

The bound moves when the trainer raises its step or frees slots (``shared.state.staleness``) and
when the weight follower advances the served version (``shared.state.policy_version``). Each
of those writes is followed by ``announce`` on the run's admission channel (Redis pub/sub, not a
key: nothing is stored). ``AdmissionWake.pause`` waits for such an announcement, or ``timeout``
seconds, whichever comes first.

Invariants:
- A wake-up is a hint, never the decision: the waiter always re-checks the bound
  (``StalenessBudget.try_admit``), and it still polls at ``timeout``. So a lost announcement (no
  subscriber yet, a dropped connection, a Redis restart) costs at most one poll interval,
  as before this module existed, and never admits a group.
- No wake-up is lost between a failed check and the wait: the first ``pause`` subscribes and
  returns at once (on the subscription's confirmation), so the next check runs after the
  subscription is in place.
- Pub/sub delivers to every subscriber: every intake process of the run wakes (each then
  competes in ``try_admit``'s one Lua call, so the bound holds as before).
- The channel carries the run's hash tag, so on a Redis Cluster it names the run's slot like
  the run's keys do.
"""

from __future__ import annotations

import time
from typing import Any

import redis


def admission_channel(run_id: str) -> str:
    return f"conveyor:{{{run_id}}}:admission_changed"


def announce(client_or_transaction: Any, run_id: str) -> None:
    """The run's staleness bound may have moved (with a transaction: when it commits)."""
    client_or_transaction.publish(admission_channel(run_id), "1")


class AdmissionWake:
    """One waiter's subscription to its run's admission channel (opened by the first ``pause``)."""

    def __init__(self, client: redis.Redis, run_id: str):
        self.client, self.channel = client, admission_channel(run_id)
        self._pubsub: Any = None

    def pause(self, timeout: float) -> None:
        """Return on the next announcement, or after ``timeout`` seconds."""
        try:
            if self._pubsub is None:
                self._pubsub = self.client.pubsub(ignore_subscribe_messages=True)
                self._pubsub.subscribe(self.channel)
            self._pubsub.get_message(timeout=timeout)  # the first returns on the subscription's confirmation
        except redis.RedisError:
            self.close()  # a poll interval, as without wake-ups; the next pause subscribes again
            time.sleep(timeout)

    def close(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            try:
                pubsub.close()
            except redis.RedisError:
                pass
