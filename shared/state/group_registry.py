"""The group registry of a run: which GRPO groups exist, which intake published, which the
trainer completed. The one owner of these Redis keys (``RedisKeys.groups``,
``groups_published``, ``groups_done``); no service names them itself.

Invariants:
- A group's registration (``GroupRegistration``: expected size, task, policy version at
  dispatch) is written once, before its trajectories are registered in the ledger, and never
  changed: ``register`` is a set-if-absent, so a re-run of intake keeps the first one and a
  reader may cache it for the run's life.
- A group is marked published only after its rollout task went out; a re-run of intake skips
  the groups marked published.
- A group is marked done by the trainer in the same transaction that queues it for training,
  counts it and acknowledges its events (``mark_done`` takes that transaction). While it is
  done, an event of the group is late. A group leaves the done set only when ``conveyor
  retry`` re-opens a group decided with every member failed (``shared.state.ledger_retry``, in the
  Lua call that sends its members again); the trainer then decides it once more.
"""

from __future__ import annotations

from typing import Any

from shared.names import RedisKeys
from shared.schemas import GroupRegistration, parse_message


class GroupRegistry:
    def __init__(self, client: Any, run_id: str):
        self.redis, self.run_id = client, run_id
        self.registrations_key = RedisKeys.groups(run_id)  # hash group id -> GroupRegistration JSON
        self.published_key = RedisKeys.groups_published(run_id)  # set of group ids
        self.done_key = RedisKeys.groups_done(run_id)  # set of group ids

    # --- registrations (intake writes, the trainer reads) ---------------------------------
    def register(self, registration: GroupRegistration, transaction: Any = None) -> bool | None:
        """Record the group unless it is known; True if this call recorded it. With a transaction
        (a Redis pipeline), as part of it: None, whether it recorded is its reply."""
        if registration.run_id != self.run_id:
            raise ValueError(f"registration of run {registration.run_id!r} given to the registry of {self.run_id!r}")
        writer = transaction if transaction is not None else self.redis
        recorded = writer.hsetnx(self.registrations_key, str(registration.group_id), registration.model_dump_json())
        return None if transaction is not None else bool(recorded)

    def is_registered(self, group_id: int) -> bool:
        return bool(self.redis.hexists(self.registrations_key, str(group_id)))

    def get(self, group_id: int) -> GroupRegistration:
        """The registration; ``KeyError`` if intake never registered the group, ``BadMessage``
        if what is stored does not parse."""
        raw = self.redis.hget(self.registrations_key, str(group_id))
        if raw is None:
            raise KeyError(f"group {group_id} of run {self.run_id} was never registered by intake")
        return parse_message(GroupRegistration, raw, f"registration of group {group_id}")

    def registered_count(self) -> int:
        return int(self.redis.hlen(self.registrations_key))

    def registrations(self) -> dict[int, GroupRegistration]:
        return {int(g): parse_message(GroupRegistration, raw) for g, raw in self.redis.hgetall(self.registrations_key).items()}

    def registrations_in(self, group_ids: range) -> dict[int, GroupRegistration]:
        """The registrations of those groups that intake registered, by id, in ``group_ids``' order."""
        raw = self.redis.hmget(self.registrations_key, [str(g) for g in group_ids])
        return {g: parse_message(GroupRegistration, r) for g, r in zip(group_ids, raw) if r is not None}

    # --- published (intake) ---------------------------------------------------------------
    def mark_published(self, group_id: int, transaction: Any = None) -> None:
        """With a transaction (a Redis pipeline), as part of it."""
        (transaction if transaction is not None else self.redis).sadd(self.published_key, group_id)

    def is_published(self, group_id: int) -> bool:
        return bool(self.redis.sismember(self.published_key, group_id))

    def published_count(self) -> int:
        return int(self.redis.scard(self.published_key))

    # --- done (the trainer) ---------------------------------------------------------------
    def mark_done(self, group_id: int, transaction: Any) -> None:
        """Queue the mark on the caller's transaction (a Redis pipeline), with the rest of the
        group's hand-off: see the module invariants."""
        transaction.sadd(self.done_key, group_id)

    def is_done(self, group_id: int) -> bool:
        return bool(self.redis.sismember(self.done_key, group_id))

    def done(self) -> set[int]:
        return {int(g) for g in self.redis.smembers(self.done_key)}
