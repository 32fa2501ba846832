"""The trainer's consumer: reads the run's trainer stream, assembles GRPO groups, applies the
decision on each (``services.trainer.group_decision``): batches to object storage, the train
queue, the ledger, counters and metrics.

Invariants:
- Stream entries are acknowledged only after their group was fully handled: batch and group
  record written, the members carried inline written to the group's spill
  (``shared.inline_trajectories.spill_group``: consuming them deletes them from Redis), members
  moved scored -> consumed, group marked done. A trainer that dies
  at any point re-reads its pending entries on restart and finishes the same groups; every
  write on that path is idempotent (fixed keys, guarded ledger moves, set membership).
  So a restart loses no group and trains no group twice.
- The groups one read completes are assembled ``trainer.assembly_threads`` at a time (siblings
  overlap: a step's last group no longer waits behind the others' reads and writes); each
  group's own writes keep their order, and each group's transaction is its own, so a crash
  leaves every group done or pending, never half. An entry of a group the read in hand already
  completed is late, as it is once the group is marked done.
- What becomes of a completed group is decided by ``services.trainer.group_decision`` (pure:
  accepted, zero_variance, all_failed, filtered or stale); this module applies the decision and
  counts each group by its status. With ``trainer.mode: train`` the staleness bound at use
  (``max_staleness_at_use``, by default ``max_off_policy_steps``) is asked of each group and a dropped group frees its admission slot;
  with ``assemble`` nothing is stale. An accepted group's batch is
  written, and its batch key goes on the run's append-only train queue in the same transaction
  that marks the group done; a dropped zero-variance or filtered group goes there too, as a
  ``skip`` entry with its rewards, so a step can count it (reward metrics, and the cap on extra
  groups a step waits for). Every group's members are consumed: every
  trajectory reaches the trainer exactly once, trained on or not.
- With redundancy (a registration with ``keep``), a group is decided once ``keep`` members are
  scored; its other members are failed as ``superseded`` (``_supersede``) before the group is
  marked done, so the ledger stays exact: dispatched = consumed + failed. Their own events,
  arriving after, are late.
- A group's metrics line (``trainer.metrics_path``) is written exactly once: before the
  transaction that marks the group done, idempotently by (group, the entry that completed it)
  (``services.trainer.group_metrics``), so a replay after a crash finds it written.
- One bad event (one that does not fit ``TrainerEvent``, or names an unknown group) is logged
  with its entry id, counted and acknowledged (it stays in the stream); one that does not
  parse is also dead-lettered (``shared.state.dead_letters``). The consumer goes on.
- The run's Redis records are read and written through their owners: ``GroupRegistry``,
  ``TrainerCounters``, ``StalenessBudget``; train-queue entries are ``TrainQueueEntry``.
- An outage of Redis or of the S3 server is waited out (``shared.outage``); after Redis comes
  back, the consumer re-reads its pending entries it does not hold, in case a read's reply
  was lost with the connection.
- A run whose data Redis lost (``shared.state.run_marker``: checked at start, against the object
  store too, and at every poll) stops the consumer with ``RedisDataLost``: it never goes on
  with an empty ledger. Its writes outside the ledger's guarded moves (a group's transaction,
  an event counted alone) are ``RunMarker.guarded``, so one that waited out the Redis restart
  that lost the run is refused, not applied to the empty Redis.
- The loop that reads (``services.trainer.process.TrainerProcess``) asks ``keep_reading`` before
  each read, and stops only between two reads, never in the middle of a group: what was read and
  not yet decided stays pending in the stream.
- A stopped run (``conveyor run stop``, ``shared.state.run_stop``) ends the consumer between two reads
  or two steps, never within a step: it first fails every trajectory of the run still
  unfinished, groups read and not yet decided included, so the run's ledger is exact.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, cast

import redis
from redis.typing import KeyT, StreamIdT

from services.trainer.batch_handoff import BatchHandoff
from services.trainer.group_decision import decide_group
from services.trainer.group_filters import build_filter
from services.trainer.group_metrics import GroupMetricsLog
from services.trainer.groups import GroupAssembler, PendingGroup
from shared import outage
from shared.state.ledger import UNFINISHED, Ledger
from shared.outcomes import FailureKind, reason
from shared.names import batch_key, group_record_key
from shared.state.run_marker import TRAINER_STOPS, RunMarker
from shared.state.run_records import RunRecords
from shared.state.run_stop import RunStop, end_unfinished, stop_of
from shared.state.dead_letters import DeadLetters
from shared.state.group_registry import GroupRegistry
from shared.schemas import (
    BadMessage,
    GroupRecord,
    GroupRegistration,
    ScoredEvent,
    TrainerEvent,
    Trajectory,
    parse_message,
)
from shared.settings import Settings
from shared.state.staleness import budget_of
from shared.storage import ObjectStore, put_model
from shared.inline_trajectories import is_inline_ref, spill_group
from shared.trajectory_lookup import trajectory_of_event
from shared.state.trainer_reads import TRAINER_CONSUMER_GROUP
from shared.state.train_queue import TrainQueue
from shared.state.trainer_counters import TrainerCounter, TrainerCounters
from shared.state.trainer_stream import stream_key

log = logging.getLogger(__name__)
# the Redis consumer group that reads the trainer stream (a group of stream readers, not a GRPO
# group); named in shared: intake reads whether a trainer reads the run
STREAM_READERS = TRAINER_CONSUMER_GROUP
_STOPS = TRAINER_STOPS


@dataclass
class TrainerConsumer:
    settings: Settings
    client: redis.Redis  # the Redis that holds the run: every owner below is built on it
    store: ObjectStore
    handoff: BatchHandoff | None = None  # mode train: accepted batches kept for this process's training loop

    def __post_init__(self) -> None:
        self.run_id = self.settings.run_id
        self.ledger = Ledger(self.client, self.settings.ledger.dispatch_ttl_s)
        self.stream = stream_key(self.run_id)
        self.reader_name = self.settings.trainer.consumer_name  # this reader in STREAM_READERS
        self._registrations: dict[int, GroupRegistration] = {}
        self.stopped: RunStop | None = None  # the run's stop, once this consumer ended on it
        self.groups = GroupRegistry(self.client, self.run_id)
        self.trainer_counters = TrainerCounters(self.client, self.run_id)
        self.train_queue = TrainQueue(self.client, self.run_id)
        self.dead_letters = DeadLetters(self.client)
        self._completing: set[int] = set()  # groups completed by the read in hand, not yet marked done
        self.assembler = GroupAssembler(self._expected_size, lambda g: g in self._completing or self.groups.is_done(g),
                                        lambda g: self._registration(g).keep)
        trainer = self.settings.trainer
        self.group_filters = [build_filter(spec) for spec in trainer.group_filters]
        self.budget = budget_of(self.client, self.run_id, trainer)  # mode train: it throttles rollouts to the steps
        if self.budget is not None and self.budget.max_staleness_at_use > self.budget.max_off_policy_steps \
                and trainer.loss.correction == "none":
            log.warning("trainer.max_staleness_at_use %d trains groups up to that many steps old with "
                        "trainer.loss.correction none: only the PPO clip bounds their update (docs/configuration.md)",
                        self.budget.max_staleness_at_use)
        self.metrics = GroupMetricsLog(Path(self.settings.trainer.metrics_path), self.run_id)
        self.marker = RunMarker(self.client, self.run_id, self.store)
        self.marker.check(_STOPS, look_in_store=True)  # before anything of the run is created again
        self._recoveries = outage.recoveries(self.client)
        # writes groups' inline members to their spill (_spill); one per assembling thread
        self._spiller = ThreadPoolExecutor(trainer.assembly_threads, thread_name_prefix="inline-spill")
        self._assembler_pool = ThreadPoolExecutor(trainer.assembly_threads, thread_name_prefix="group-assembly") \
            if trainer.assembly_threads > 1 else None
        self._read_at = 0.0  # wall time the last read returned: each group's metrics line says when it was read
        try:
            self.client.xgroup_create(self.stream, STREAM_READERS, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # --- reading ----------------------------------------------------------------------------
    def recover(self) -> int:
        """Replay this consumer's pending (delivered, unacknowledged) entries that it does not
        hold: all of them after a restart, the ones whose reply was lost after an outage."""
        held = {entry_id for group in self.assembler.pending.values() for entry_id in group.entry_ids}
        replayed = 0
        last = "0"
        while True:
            batch = self._read({self.stream: last}, count=500)
            entries = batch[0][1] if batch else []
            if not entries:
                return replayed
            self._read_at = time.time()
            completed = []
            for entry_id, fields in entries:
                if entry_id not in held:
                    completed += self._handle(entry_id, fields)
                    replayed += 1
                last = entry_id
            self._complete_all(completed)

    def poll(self, block_ms: int | None = None) -> int:
        batch = self._read({self.stream: ">"}, count=256, block=self.settings.trainer.block_ms if block_ms is None else block_ms)
        entries = batch[0][1] if batch else []
        self._read_at = time.time()
        self._complete_all([group for entry_id, fields in entries for group in self._handle(entry_id, fields)])
        return len(entries)

    def keep_reading(self) -> bool:
        """Before each read: stop with ``RedisDataLost`` if Redis lost the run; False once the
        run is stopped (``end_if_stopped``); after an outage of Redis, replay the pending
        entries whose reply may have been lost with the connection."""
        self.marker.check(_STOPS)
        if self.end_if_stopped():
            return False
        if outage.recoveries(self.client) != self._recoveries:  # Redis was down
            self._recoveries = outage.recoveries(self.client)
            self.recover()
        return True

    def end_if_stopped(self) -> bool:
        """True once the run is stopped (``shared.state.run_stop``): every trajectory of it still
        unfinished is failed first, and the stop is logged with who asked and why."""
        stop = stop_of(self.client, self.run_id)
        if stop is None:
            return False
        failed = end_unfinished(self.ledger, self.run_id, stop, UNFINISHED)
        log.warning("trainer of run %s: the run was %s; %d unfinished trajectories failed; exiting after the last step",
                    self.run_id, stop.describe(), failed)
        self.stopped = stop
        return True

    def _read(self, streams: dict[KeyT, StreamIdT], count: int, block: int | None = None) -> list:
        try:
            # RESP2 (redis-py's default protocol): a list of [stream, entries]
            return cast(list, self.client.xreadgroup(STREAM_READERS, self.reader_name, streams, count=count, block=block))
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc):  # the stream is gone: say so if Redis lost the run
                self.marker.check(_STOPS)
            raise

    def finished(self) -> bool:
        """Intake is done and every trajectory of the run is terminal."""
        if not RunRecords(self.client, self.run_id).intake_done():
            return False
        counts = self.ledger.counts(self.run_id)
        return counts["queued"] + counts["running"] + counts["uploaded"] + counts["scored"] == 0

    # --- one entry --------------------------------------------------------------------------
    def _handle(self, entry_id: str, fields: dict[str, str]) -> list[PendingGroup]:
        """The group this entry completed, if any, to be assembled with the read's others (``_complete_all``)."""
        try:
            if "event" not in fields:
                raise BadMessage("trainer event", "the stream entry has no 'event' field", fields)
            event = parse_message(TrainerEvent, fields["event"])
            self._expected_size(event.group_id)  # unknown group -> KeyError now, not later
        except (KeyError, BadMessage) as exc:  # the entry stays in the stream; it is acked, not deleted
            self._count(TrainerCounter.bad_events)  # first: a group unknown since Redis lost the run stops here
            log.error("trainer stream entry %s rejected: %s", entry_id, exc)
            if isinstance(exc, BadMessage):
                self.dead_letters.add(f"{self.stream} entry {entry_id}", exc)
            self.client.xack(self.stream, STREAM_READERS, entry_id)
            return []
        outcome, group = self.assembler.add(event, entry_id)
        if outcome != "added":
            self._count(TrainerCounter.duplicate_events if outcome == "duplicate" else TrainerCounter.late_events)
            if outcome == "late":
                self.client.xack(self.stream, STREAM_READERS, entry_id)
            return []
        if group is None:
            return []
        self._completing.add(group.group_id)  # decided: a later entry of the same read is late
        return [group]

    def _complete_all(self, groups: list[PendingGroup]) -> None:
        """Assemble the groups one read completed, ``trainer.assembly_threads`` at a time: each
        group's path (members read, batch and record written, then its own transaction) is the
        one ``_complete`` follows alone, so each keeps its order of writes; only siblings overlap."""
        try:
            if len(groups) > 1 and self._assembler_pool is not None:
                futures = [self._assembler_pool.submit(self._complete, group) for group in groups]
                wait(futures)  # every sibling ends (done, or failed before its transaction) before an error is raised
                for future in futures:
                    future.result()
            else:
                for group in groups:
                    self._complete(group)
        finally:
            self._completing.clear()

    def _complete(self, group: PendingGroup) -> None:
        """Apply the group's decision (``services.trainer.group_decision``)."""
        started, started_at = time.perf_counter(), time.time()
        registration = self._registration(group.group_id)
        read: dict[str, Trajectory] = {}  # ref -> the member the decision read: the spill reuses it

        def read_member(event: ScoredEvent) -> Trajectory:
            trajectory = trajectory_of_event(self.store, event, self.client)
            if event.trajectory_key:
                read[event.trajectory_key] = trajectory
            return trajectory

        decision = decide_group(group, self.run_id, self.settings.trainer, self.group_filters, read_member,
                                None if self.budget is None else self._is_stale)
        spill = self._spill(group, read)  # beside the batch and the record: off the group's critical path
        batch_object = None
        if decision.batch is not None:
            batch_object = batch_key(self.run_id, group.group_id)
            put_model(self.store, batch_object, decision.batch)
            if self.handoff is not None:  # written first: S3 holds what the loop takes from memory
                self.handoff.keep(batch_object, decision.batch)
        record = decision.record(self.run_id, registration.expected_size, batch_object, completed_at=time.time())
        put_model(self.store, group_record_key(self.run_id, group.group_id), record)
        if spill is not None:
            spill.result()  # written before consuming the members deletes their inline copies
        self.ledger.mark_consumed_many([e.trajectory_id for e in group.scored])
        superseded = self._supersede(registration, group)
        self._log_metrics(record, registration, group.entry_ids[-1], assembly_s=time.perf_counter() - started,
                          timeline={"read_at": self._read_at, "assembly_started_at": started_at})
        entry = decision.queue_entry(batch_object, registration.env_name)

        def fill(tx: redis.client.Pipeline) -> None:  # done, counted, queued and acked together
            self.groups.mark_done(group.group_id, tx)
            self.trainer_counters.add(TrainerCounter.for_group_status(decision.status), transaction=tx)
            if superseded:
                self.trainer_counters.add(TrainerCounter.superseded, superseded, transaction=tx)
            if decision.zero_variance_kept:
                self.trainer_counters.add(TrainerCounter.groups_zero_variance_kept, transaction=tx)
            if not decision.accepted and self.budget is not None:
                self.budget.filtered(1, transaction=tx)  # a dropped group frees its admission slot
            if entry is not None:
                self.train_queue.append(entry, transaction=tx)
            tx.xack(self.stream, STREAM_READERS, *group.entry_ids)

        self._commit(group.group_id, fill)

    def _spill(self, group: PendingGroup, read: dict[str, Trajectory]) -> Future[str | None] | None:
        """The group's members carried inline, being written to its spill in a thread
        (``shared.inline_trajectories.spill_group``; ``read``: those the decision already read);
        None when it has none."""
        refs = [e.trajectory_key or "" for e in group.scored]
        if not any(map(is_inline_ref, refs)):
            return None
        return self._spiller.submit(spill_group, self.store, self.client, self.run_id, group.group_id, refs, read)

    def _is_stale(self, oldest_policy_version: int) -> bool:
        budget = self.budget
        return budget is not None and budget.is_stale(oldest_policy_version, budget.state().trainer_step)

    def _supersede(self, registration: GroupRegistration, group: PendingGroup) -> int:
        """Redundancy: fail the members the decided group does not keep (``superseded``); their
        workers cancel them at the next heartbeat. Idempotent (a failed member stays failed), so
        a replay after a crash fails none twice. Returns how many this call failed."""
        kept = {e.trajectory_id for e in group.scored}
        failed = 0
        for trajectory_id in registration.members:
            if trajectory_id in kept or trajectory_id in group.events and group.events[trajectory_id].kind == "failed":
                continue
            detail = f"group {group.group_id} kept its first {registration.keep} scored members"
            failed += self.ledger.fail(trajectory_id, reason(FailureKind.superseded, detail)).ok
        return failed

    def _commit(self, group_id: int, fill: Callable[[redis.client.Pipeline], None]) -> None:
        """Run a group's final transaction exactly once, and never into a Redis that lost the run
        (``RunMarker.guarded`` watches the run's marker, and here the done set too). A transaction
        cut by a lost connection is looked at again: done already (its reply was lost), or done now."""
        done = self.groups.done_key
        self.marker.guarded(fill, _STOPS, watch=(done,), unless=lambda tx: bool(tx.sismember(done, str(group_id))))

    def _count(self, counter: TrainerCounter) -> None:
        """Count one event outside a group's transaction, never into a Redis that lost the run."""
        self.marker.guarded(lambda tx: self.trainer_counters.add(counter, transaction=tx), _STOPS)

    # --- bookkeeping ------------------------------------------------------------------------
    def _registration(self, group_id: int) -> GroupRegistration:
        """Intake writes a group's registration once and never changes it: read it once."""
        cached = self._registrations.get(group_id)
        if cached is None:
            cached = self._registrations[group_id] = self.groups.get(group_id)
        return cached

    def _expected_size(self, group_id: int) -> int:
        return self._registration(group_id).expected_size

    def counters(self) -> dict[str, int]:
        return self.trainer_counters.all()

    def _log_metrics(self, record: GroupRecord, registration: GroupRegistration, completed_by: str, assembly_s: float,
                     timeline: dict[str, float]) -> None:
        """Idempotent by (group, the entry that completed it): see ``services.trainer.group_metrics``.
        ``timeline``: wall times of the group's last hop, for the step's breakdown (``bench/loop_speed.py``):
        ``read_at`` (the read that returned the completing entry; its id holds the time it was
        added to the stream) and ``assembly_started_at`` (after the entries read before it)."""
        line = {
            "time": record.completed_at, "run_id": self.run_id, "group_id": record.group_id, "status": record.status,
            "reward_mean": record.reward_mean, "reward_std": record.reward_std,
            "scored": sum(1 for m in record.members if m.reward is not None),
            "failed": sum(1 for m in record.members if m.reward is None),
            "group_latency_s": record.completed_at - registration.dispatched_at, "assembly_s": assembly_s, **timeline,
        }
        self.metrics.write(line, completed_by)
        log.info("group %d %s: reward mean %s std %s", record.group_id, record.status, record.reward_mean, record.reward_std)
