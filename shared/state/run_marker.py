"""Detecting that Redis lost a run's data, so that no service goes on with an empty ledger.

A run's marker is written twice when the run starts: into Redis (``RedisKeys.run_marker``,
by ``RunMarker.open`` and by every ``Ledger.register`` in the same Lua call as the
trajectories), then into the object store (``run_marker_key``), which outlives Redis.

Invariants:
- Redis holds a run's marker for as long as it holds anything of the run: the marker is
  written with (or before) the run's first trajectory and nothing deletes it.
- A run whose Redis marker is gone, while the store holds its marker, or this process saw the
  Redis marker before, or a task of the run exists (tasks are published only after the
  registration), has lost its Redis data: a restart without AOF, a FLUSHALL, a new Redis.
  ``RunMarker.check`` then raises ``RedisDataLost`` naming the run; intake, the trainer and
  the weight follower stop with that line and exit code 2, and workers refuse the run's
  tasks with one error line per run.
- Nothing recreates a lost run: once intake opened a run, its registrations require the
  marker in the same Lua call (``Ledger.register(require_marker=True)``), and intake refuses to
  open a run the store knows but Redis does not. A service's other writes of the run's records
  (intake's; the trainer's counters, selections, steps, announcements and eval ends; the
  weight follower's served version and sync records) are refused too, not applied to an empty
  Redis, even one restarted while the write waited out the outage (a check before a write
  would not do: the write lands after the outage). Plain commands go through
  ``RunMarker.guarded``, one transaction that watches the marker; a Lua script requires the
  marker in its own call (``RunMarker.run_script``: the marker is its last KEY, and it returns
  ``LOST`` without writing when the marker is gone). Scripts stay out of transactions: a
  cluster's pipeline refuses EVALSHA (``shared.state.redis_scripts``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable, cast

import redis
from redis.commands.core import Script

from shared.names import RedisKeys, run_marker_key
from shared.storage import ObjectStore, StorageError

log = logging.getLogger(__name__)


LOST = -1  # what a script that requires the run's marker (its last KEY) returns when it is gone, having written nothing

# what a service does on a lost run, as its line says it
TRAINER_STOPS = "stops rather than train on it"
FOLLOWER_STOPS = "stops following it"
INTAKE_STOPS = "registers nothing more of it"


class RedisDataLost(RuntimeError):
    """Redis no longer holds a run it held: its ledger is empty or partial."""


def marker_value(run_id: str) -> str:
    return json.dumps({"run_id": run_id, "created_at": time.time()})


def lost_message(run_id: str, evidence: str, consequence: str) -> str:
    return (f"Redis lost its data: the marker of run {run_id} ({RedisKeys.run_marker(run_id)}) is gone, though "
            f"{evidence}; its ledger is empty or partial, so this service {consequence}. Restore Redis from its "
            f"AOF or a backup, or start the run again under a new run id")


class RunMarker:
    """The marker of one run, as one service sees it."""

    def __init__(self, client: redis.Redis, run_id: str, store: ObjectStore | None = None):
        self.redis, self.run_id, self.store = client, run_id, store
        self.key = RedisKeys.run_marker(run_id)
        self.seen = False

    def open(self) -> None:
        """Intake, before registering anything: write the marker (Redis first, then the store),
        or raise ``RedisDataLost`` if the store knows the run and Redis does not."""
        if not self.redis.exists(self.key):
            if self._in_store():
                raise RedisDataLost(lost_message(self.run_id, f"the object store holds it ({run_marker_key(self.run_id)})",
                                                 "does not register the run again"))
            self.redis.set(self.key, marker_value(self.run_id), nx=True)
        self.seen = True
        if self.store is not None and not self._in_store():
            marker = cast(str, self.redis.get(self.key))  # set above; the client decodes replies
            self.store.put_bytes(run_marker_key(self.run_id), marker.encode(), "application/json")

    def in_redis(self) -> bool:
        return bool(self.redis.exists(self.key))

    def check(self, consequence: str, look_in_store: bool = False) -> None:
        """Raise ``RedisDataLost`` if Redis lost the run; ``look_in_store`` (at a service's
        start) also asks the object store whether the run existed."""
        if self.redis.exists(self.key):
            self.seen = True
            return
        if self.seen:
            raise RedisDataLost(lost_message(self.run_id, "this service saw it earlier", consequence))
        if look_in_store and self._in_store():
            raise RedisDataLost(lost_message(self.run_id, f"the object store holds it ({run_marker_key(self.run_id)})", consequence))

    def guarded(self, fill: Callable[[Any], object], consequence: str, watch: tuple[str, ...] = (),
                unless: Callable[[Any], bool] | None = None) -> list[Any] | None:
        """Apply ``fill``'s writes (queued on a Redis transaction) once, and only while Redis holds
        the run: the transaction watches the marker (and ``watch``), so a Redis that lost the
        run's data meanwhile, a restart the write waited out included, raises ``RedisDataLost``
        (``consequence``: what this service does then) and applies nothing. A run whose marker
        was never written (a trainer started before intake) is written to, as before the marker.
        ``unless`` (asked under the watch) says the writes were made already: None is returned.
        Else EXEC's replies, one per queued command."""
        while True:
            try:
                with self.redis.pipeline(transaction=True) as tx:
                    tx.watch(self.key, *watch)
                    if tx.exists(self.key):
                        self.seen = True
                    else:
                        self.check(consequence, look_in_store=True)  # raises if the run was lost
                    if unless is not None and unless(tx):
                        return None
                    tx.multi()
                    fill(tx)
                    return cast(list[Any], tx.execute())
            except redis.WatchError:  # a watched key moved, or the connection dropped while watching
                self.check(consequence)

    def run_script(self, script: Script, keys: list[str], args: list[Any], consequence: str) -> Any:
        """Run ``script`` only while Redis holds the run: called with the marker as its last KEY,
        the script returns ``LOST`` and writes nothing when the marker is gone. Then a lost run
        raises ``RedisDataLost``; a run not opened yet (a trainer started before intake) is
        written to without the requirement, as before the marker."""
        reply = script(keys=[*keys, self.key], args=args)
        if reply != LOST:
            self.seen = True
            return reply
        self.check(consequence, look_in_store=True)
        return script(keys=keys, args=args)

    def _in_store(self) -> bool:
        if self.store is None:
            return False
        try:
            self.store.get_bytes(run_marker_key(self.run_id))
        except StorageError:  # not there
            return False
        return True


def run_script(marker: RunMarker | None, script: Script, keys: list[str], args: list[Any], consequence: str) -> Any:
    """An owner's script call: as is without a ``marker``, else never into a Redis that lost the
    run (``RunMarker.run_script``; ``consequence``: what the caller does then)."""
    return script(keys=keys, args=args) if marker is None else marker.run_script(script, keys, args, consequence)


_refused: set[str] = set()
_refused_lock = threading.Lock()


def refuse_lost_run(client: redis.Redis, run_id: str) -> bool:
    """For a worker holding a task of the run whose trajectory the ledger does not know: True
    when Redis lost the run (its marker is gone), said once per run and process."""
    if client.exists(RedisKeys.run_marker(run_id)):
        return False
    with _refused_lock:
        first = run_id not in _refused
        _refused.add(run_id)
    if first:
        log.error("%s", lost_message(run_id, "a task of the run exists", "refuses the run's tasks and recreates nothing"))
    return True
