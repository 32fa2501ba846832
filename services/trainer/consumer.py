"""The trainer's consumer: reads the run's trainer stream, assembles GRPO groups, computes
advantages, emits training batches to object storage and logs metrics.

Invariants:
- Stream entries are acknowledged only after their group was fully handled: batch and group
  record written, members moved scored -> consumed, group marked done. A trainer that dies
  at any point re-reads its pending entries on restart and finishes the same groups; every
  write on that path is idempotent (fixed keys, guarded ledger moves, set membership).
  So a restart loses no group and trains no group twice.
- A group is accepted for training only if at least two scored members disagree and, with
  a staleness bound, its oldest turn is at most ``max_off_policy_steps`` behind the trainer;
  zero-variance, all-failed and stale groups are dropped, counted, and free their admission
  slot. Accepted groups' batch keys go on the run's append-only train queue in the same
  transaction that marks the group done. Their members are still consumed: every
  trajectory reaches the trainer exactly once, trained on or not.
- One bad event (unparseable, or naming an unknown group) is logged with its entry id,
  counted and acknowledged; the consumer goes on.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import redis

from services.trainer.advantages import group_advantages
from services.trainer.groups import GroupAssembler, PendingGroup
from shared.ledger import Ledger
from shared.names import RedisKeys, batch_key, group_record_key
from shared.schemas import (
    GroupMember,
    GroupRecord,
    GroupRegistration,
    ScoredTrajectory,
    TrainerEvent,
    TrainingBatch,
    TrainingSample,
    Trajectory,
)
from shared.settings import Settings
from shared.staleness import StalenessBudget
from shared.storage import ObjectStore, get_model, put_model

if TYPE_CHECKING:
    from services.trainer.loop import TrainingLoop

log = logging.getLogger(__name__)
CONSUMER_GROUP = "trainer"


@dataclass
class TrainerConsumer:
    settings: Settings
    ledger: Ledger
    store: ObjectStore

    def __post_init__(self) -> None:
        self.run_id = self.settings.run_id
        self.redis: redis.Redis = self.ledger.redis
        self.stream = RedisKeys.trainer_stream(self.run_id)
        self.consumer = self.settings.trainer.consumer_name
        self._registrations: dict[int, GroupRegistration] = {}
        self.assembler = GroupAssembler(self._expected_size, self._is_done)
        trainer = self.settings.trainer
        self.budget = None
        if trainer.max_off_policy_steps is not None:
            self.budget = StalenessBudget(self.redis, self.run_id, trainer.max_off_policy_steps, trainer.groups_per_step)
        self.metrics_path = Path(self.settings.trainer.metrics_path)
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.redis.xgroup_create(self.stream, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # --- reading ----------------------------------------------------------------------------
    def recover(self) -> int:
        """Replay this consumer's pending (delivered, unacknowledged) entries after a restart."""
        replayed = 0
        last = "0"
        while True:
            batch = self.redis.xreadgroup(CONSUMER_GROUP, self.consumer, {self.stream: last}, count=500)
            entries = batch[0][1] if batch else []
            if not entries:
                return replayed
            for entry_id, fields in entries:
                self._handle(entry_id, fields)
                last = entry_id
            replayed += len(entries)

    def poll(self, block_ms: int | None = None) -> int:
        batch = self.redis.xreadgroup(
            CONSUMER_GROUP, self.consumer, {self.stream: ">"}, count=256,
            block=self.settings.trainer.block_ms if block_ms is None else block_ms,
        )
        entries = batch[0][1] if batch else []
        for entry_id, fields in entries:
            self._handle(entry_id, fields)
        return len(entries)

    def run_forever(self, stop_when_idle: bool = False, loop: "TrainingLoop | None" = None) -> None:
        """Consume events; with a training loop, train whenever a step's groups are in."""
        self.recover()
        while True:
            handled = self.poll()
            while loop is not None and not loop.done() and loop.ready():
                loop.train_once()
            if loop is not None and loop.done():
                return
            if stop_when_idle and not handled and self.finished():
                return

    def finished(self) -> bool:
        """Intake is done and every trajectory of the run is terminal."""
        if not self.redis.get(RedisKeys.intake_done(self.run_id)):
            return False
        counts = self.ledger.counts(self.run_id)
        return counts["queued"] + counts["running"] + counts["uploaded"] + counts["scored"] == 0

    # --- one entry --------------------------------------------------------------------------
    def _handle(self, entry_id: str, fields: dict[str, str]) -> None:
        try:
            event = TrainerEvent.model_validate_json(fields["event"])
            self._expected_size(event.group_id)  # unknown group -> KeyError now, not later
        except (KeyError, ValueError) as exc:
            log.error("trainer stream entry %s rejected: %s", entry_id, exc)
            self._count("bad_events")
            self.redis.xack(self.stream, CONSUMER_GROUP, entry_id)
            return
        outcome, group = self.assembler.add(event, entry_id)
        if outcome != "added":
            self._count(f"{outcome}_events")
            if outcome == "late":
                self.redis.xack(self.stream, CONSUMER_GROUP, entry_id)
            return
        if group is not None:
            self._complete(group)

    def _complete(self, group: PendingGroup) -> None:
        started = time.perf_counter()
        registration = self._registration(group.group_id)
        scored = group.scored
        rewards = [e.reward for e in scored]
        members: list[GroupMember] = [
            GroupMember(trajectory_id=e.trajectory_id, reward=None, advantage=None, failure_reason=e.failure_reason)
            for e in group.failed
        ]
        batch_object, oldest = None, None
        if not scored:
            status, mean, std = "all_failed", None, None
        else:
            adv = group_advantages(rewards, self.settings.trainer.advantage_eps, self.settings.trainer.scale_advantage_by_std)
            mean, std = adv.mean, adv.std
            members += [
                GroupMember(trajectory_id=e.trajectory_id, reward=e.reward, advantage=a)
                for e, a in zip(scored, adv.advantages)
            ]
            if adv.zero_variance:
                status = "zero_variance"
            else:
                batch = self._batch(group.group_id, scored, adv.advantages)
                oldest = min(sample.oldest_policy_version for sample in batch.samples)
                if self.budget is not None and self.budget.is_stale(oldest, self.budget.state().trainer_step):
                    status = "stale"
                else:
                    status = "accepted"
                    batch_object = batch_key(self.run_id, group.group_id)
                    put_model(self.store, batch_object, batch)
        record = GroupRecord(
            run_id=self.run_id, group_id=group.group_id, expected_size=registration.expected_size,
            members=sorted(members, key=lambda m: m.trajectory_id), reward_mean=mean, reward_std=std,
            status=status, batch_key=batch_object, completed_at=time.time(),
        )
        put_model(self.store, group_record_key(self.run_id, group.group_id), record)
        for e in scored:
            self.ledger.mark_consumed(e.trajectory_id)
        self._log_metrics(record, registration, assembly_s=time.perf_counter() - started)
        with self.redis.pipeline(transaction=True) as tx:  # done, counted, queued and acked together
            tx.sadd(RedisKeys.groups_done(self.run_id), group.group_id)
            tx.hincrby(RedisKeys.trainer_counters(self.run_id), f"groups_{status}", 1)
            if batch_object is not None:
                entry = {"key": batch_object, "oldest_policy_version": oldest, "group_id": group.group_id}
                tx.rpush(RedisKeys.train_queue(self.run_id), json.dumps(entry))
            elif self.budget is not None:
                tx.hincrby(self.budget.key, "filtered", 1)  # a dropped group frees its admission slot
            tx.xack(self.stream, CONSUMER_GROUP, *group.entry_ids)
            tx.execute()

    def _batch(self, group_id: int, scored: list[TrainerEvent], advantages: list[float]) -> TrainingBatch:
        samples = []
        for event, advantage in zip(scored, advantages):
            scored_traj = get_model(self.store, event.scored_key, ScoredTrajectory)
            trajectory = get_model(self.store, scored_traj.trajectory_key, Trajectory)
            flat = trajectory.flatten()
            samples.append(
                TrainingSample(
                    trajectory_id=event.trajectory_id, token_ids=flat.token_ids, loss_mask=flat.loss_mask,
                    inference_logprobs=flat.inference_logprobs, advantage=advantage, reward=event.reward,
                    oldest_policy_version=min((t.policy_version for t in trajectory.turns), default=0),
                    stop_reason=trajectory.stop_reason,
                )
            )
        return TrainingBatch(run_id=self.run_id, group_id=group_id, samples=samples)

    # --- bookkeeping ------------------------------------------------------------------------
    def _registration(self, group_id: int) -> GroupRegistration:
        """Intake writes a group's registration once and never changes it: read it once."""
        cached = self._registrations.get(group_id)
        if cached is None:
            raw = self.redis.hget(RedisKeys.groups(self.run_id), str(group_id))
            if raw is None:
                raise KeyError(f"group {group_id} of run {self.run_id} was never registered by intake")
            cached = self._registrations[group_id] = GroupRegistration.model_validate_json(raw)
        return cached

    def _expected_size(self, group_id: int) -> int:
        return self._registration(group_id).expected_size

    def _is_done(self, group_id: int) -> bool:
        return bool(self.redis.sismember(RedisKeys.groups_done(self.run_id), group_id))

    def _count(self, name: str) -> None:
        self.redis.hincrby(RedisKeys.trainer_counters(self.run_id), name, 1)

    def counters(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.redis.hgetall(RedisKeys.trainer_counters(self.run_id)).items()}

    def _log_metrics(self, record: GroupRecord, registration: GroupRegistration, assembly_s: float) -> None:
        line = {
            "time": record.completed_at, "run_id": self.run_id, "group_id": record.group_id, "status": record.status,
            "reward_mean": record.reward_mean, "reward_std": record.reward_std,
            "scored": sum(1 for m in record.members if m.reward is not None),
            "failed": sum(1 for m in record.members if m.reward is None),
            "group_latency_s": record.completed_at - registration.dispatched_at, "assembly_s": assembly_s,
        }
        with self.metrics_path.open("a") as fh:
            fh.write(json.dumps(line) + "\n")
        log.info("group %d %s: reward mean %s std %s", record.group_id, record.status, record.reward_mean, record.reward_std)
