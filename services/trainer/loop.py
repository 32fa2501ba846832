"""The training loop: accepted groups -> optimizer step -> checkpoint -> new policy version.

Invariants:
- The policy version is the number of optimizer steps taken; checkpoint ``v`` holds the
  weights after step ``v``. Version 0 is the base model vLLM started with.
- Step ``v + 1`` trains on the next G (``groups_per_step``) groups of the run's append-only
  train queue after cursor ``v``, skipping groups that have become stale by then (oldest
  turn more than ``max_staleness_at_use``, by default ``max_off_policy_steps``, behind ``v``): staleness is checked when a group is
  trained on, not only when it was accepted. Dropped zero-variance groups (``skip`` entries)
  are passed over and counted; with ``max_extra_groups_per_step = c`` the step stops
  waiting once it has passed G + c fresh entries, and trains on the groups among them
  (``c = 0``: exactly the G groups generated for it, as TRL does). The selection is recorded (cursor ``v + 1``, and
  the stale groups counted) in one atomic step before training, and it is a pure function of
  the queue and ``v``, so a restarted trainer re-selects the same groups: none skipped,
  none repeated, none counted twice.
- Mixing (``trainer.min_env_share``) may defer a fresh group to a later step, never drop it
  (``services.trainer.selection``): the deferred entries are appended to the queue again in
  the same atomic commit as the selection.
- A train-queue entry that does not fit ``TrainQueueEntry`` (only a bug or a hand edit makes
  one) is logged once and passed over, and counted (``bad_train_entries``) with the selection.
- A step is announced (a ``CheckpointAnnouncement`` on the checkpoints stream) only after its checkpoint is committed, and the
  staleness step advances with it (with ``inference.weight_sync: nccl`` the version is served
  by broadcast first, and only every ``inference.weight_sync.checkpoint_every``-th version is
  checkpointed, committed and announced, in the background: ``services.trainer.broadcast_publish``;
  a restart there replays the versions the replicas serve beyond the newest checkpoint,
  without serving them again, and logging each step's metrics line only if the crash came
  before it: one line per step); on start the latest checkpoint is announced again (the
  weight follower ignores versions it already serves). With ``trainer.admit_before_served`` the
  step is recorded as under way (``StalenessBudget.begin_step``) once its selection is recorded, so
  the next step's groups are admitted while it trains and syncs; they start on its version only
  (``shared.state.staleness``), and a crash before the commit leaves them waiting for the step the
  restarted trainer trains again (on the same recorded selection).
- One metrics line per step, whatever crash came between. On the S3 and delta paths the
  checkpoint's manifest keeps the step's line (without ``checkpoint_s``): a trainer resumed at
  ``v`` whose metrics file lacks line ``v`` (its writer died between the commit and the line)
  logs it from there, marked ``recovered``.
- A step with no trainable token (all masks zero), or one the logprob alarm skipped, still
  counts as a step: the version moves on with unchanged weights, so the queue position stays
  a function of the version.
- With evaluation on (``settings.evaluation``), a version that is due is evaluated right after
  its step, before the next one (``services.trainer.evaluation``); a trainer restarted before
  the pass of its version ended runs it at start.
- With ``trainer.lora.enabled`` the policy is the served base with peft adapters
  (``services.trainer.lora``): only the adapters train, and each checkpoint serves the merged
  weights or the adapter alone (``trainer.lora.sync``), always through S3: settings refuse
  ``inference.weight_sync: nccl`` with LoRA, since the broadcast carries full weights only.
- The logprob alarm (``services.trainer.alarm``) is checked before every step and whenever
  the consumer polls, so a failed weight sync stops the run even while no group arrives.
- Under torchrun (``ranks``) this loop runs on rank 0 only; it orders every step to the other
  ranks and checkpoints with them (``services.trainer.distributed``). Without, it is one process.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from services.weights.broadcast import WeightBroadcaster
from services.trainer.alarm import ServedWeightsAlarm
from services.trainer.checkpoints import read_manifest, resume, save_checkpoint
from services.trainer.distributed import StepOrder, TrainerRanks
from services.trainer.evaluation import Evaluator
from services.trainer.metrics import MetricsSink, RewardCurve, finite_or_none, metric_name
from services.trainer.selection import Selection, select
from services.trainer.step import train_version, trainer_from_settings
from services.trainer.batch_handoff import BatchHandoff
from services.trainer.broadcast_publish import BroadcastPublisher
from services.trainer.delta_publish import DeltaPublisher
from services.policy.model import logprob_probe
from shared.names import checkpoint_prefix, weight_chain_prefix
from shared.rates import per_second, show
from shared.schemas import CheckpointAnnouncement, TrainingBatch
from shared.settings import Settings, training
from shared.state.staleness import StalenessBudget
from shared.storage import ObjectStore
from shared.state.train_queue import TrainQueue
from shared.state.trainer_counters import TrainerCounter, TrainerCounters
from shared.state.checkpoint_announcements import CheckpointAnnouncements
from shared.state.policy_version import PolicyVersion
from shared.state.run_marker import TRAINER_STOPS, RunMarker
from shared.state.run_records import RunRecords
from shared.state.step_metrics import StepMetrics
from shared.state.weight_sync_record import WeightSyncRecord

log = logging.getLogger(__name__)



@dataclass
class TrainingLoop:
    settings: Settings
    store: ObjectStore
    budget: StalenessBudget
    metrics: MetricsSink
    evaluator: Evaluator | None = None  # evaluation during training (settings.evaluation)
    ranks: TrainerRanks | None = None  # the leader of a torchrun job (services.trainer.distributed)
    broadcaster: WeightBroadcaster | None = None  # inference.weight_sync nccl: built from settings unless given
    handoff: BatchHandoff = field(default_factory=lambda: BatchHandoff(0))  # the consumer's batches in memory; 0: S3
    marker: RunMarker | None = None  # the run's marker, as the consumer saw it; None: the loop's own

    def __post_init__(self) -> None:
        self.run_id = self.settings.run_id
        self.redis = self.budget.redis
        self.run_marker = self.marker or RunMarker(self.redis, self.run_id, self.store)
        self.training = training(self.settings.trainer)  # the train variant: built in mode train only
        self.groups_per_step = self.training.groups_per_step
        trainer = self.settings.trainer
        self.trainer, self.tokenizer = trainer_from_settings(self.settings, shard=self.ranks is not None)
        self.served_alarm = ServedWeightsAlarm(self.redis, self.run_id, trainer.logprob_alarm, self.run_marker)
        self.counters = TrainerCounters(self.redis, self.run_id)
        self.weight_syncs = WeightSyncRecord(self.redis, self.run_id)
        self._reported_bad: set[int] = set()  # queue positions of bad entries already logged
        self.version, step = self.ranks.resume(self.store, self.run_id, self.trainer) if self.ranks else \
            resume(self.store, self.run_id, self.trainer.model, self.trainer.optimizer)
        self.trainer.step = step
        # inference.weight_sync nccl: broadcast, S3 checkpoint in the background (refused without CUDA)
        self.publisher = BroadcastPublisher(self.settings, self.redis, self.store, resumed_version=self.version,
                                            broadcaster=self.broadcaster) \
            if self.settings.inference.weight_sync.mode == "nccl" else None
        # inference.weight_sync delta: the checkpoint as on s3, then the version on the delta chain
        self.delta = DeltaPublisher(self.settings, self.store, PolicyVersion(self.redis, self.run_id).get) \
            if self.settings.inference.weight_sync.mode == "delta" else None
        self._in_step = False  # weights may differ from the last published version's
        self.budget.advance_step(self.version, self.run_marker)
        self.train_queue = TrainQueue(self.redis, self.run_id)
        self._last_step_at: float | None = None
        self._ready_selection: tuple[int, Selection] | None = None  # ready()'s (at version), for train_once
        self.reward_curve = RewardCurve(self.training.reward_curve, self.metrics.jsonl_path, self.training.reward_curve_path,
                                        f"{self.run_id}: mean reward per step")
        if self.version > 0:
            self._log_a_line_lost(self.version)
            self._announce(self.version)
        log.info("training loop at version %d (step %d)", self.version, step)
        self.evaluate_if_due()  # a trainer restarted in the middle of a pass finishes it

    def close(self) -> None:
        """Wait for a checkpoint still being written (nccl weight sync), write the last version's
        unless a step was in hand, and leave the weight group; under torchrun, let the other ranks return;
        finish the reward curve."""
        self.reward_curve.close()
        if self.publisher is not None:
            self.publisher.close(write_last=not self._in_step)
        if self.ranks is not None:
            self.ranks.stop()

    def evaluate_if_due(self) -> None:
        """Evaluate the current version if it is due and not yet ended; training waits for it."""
        if self.evaluator is None or not self.evaluator.due(self.version) or self.evaluator.ended(self.version):
            return
        end = self.evaluator.evaluate(self.version)
        self.metrics.log(self.version, end.metrics, jsonl_path=self.settings.evaluation.metrics_path)

    def done(self) -> bool:
        max_steps = self.training.max_steps
        return max_steps is not None and self.version >= max_steps

    def ready(self) -> bool:
        """The next step's groups are queued; the selection is kept for ``train_once``, which
        follows at once in the same thread (nothing else appends to the queue in between)."""
        selection = self._select()
        self._ready_selection = None if selection is None else (self.version, selection)
        return selection is not None

    def check_alarms(self) -> None:
        """Raise ``LogprobAlarm`` (action stop) if a weight sync of this run did not take."""
        self.served_alarm.check()

    def _select(self) -> Selection | None:
        """The next step's groups, or None while the queue does not hold them yet."""
        trainer = self.training
        cursor, entries = self.train_queue.after_version(self.version)
        selection = select(entries, cursor, self.version,
                           self.groups_per_step, self.budget.is_stale, trainer.max_extra_groups_per_step,
                           trainer.min_env_share, trainer.mixing_window)
        for position, reason in selection.bad.items():
            if position not in self._reported_bad:  # logged once; counted with the selection
                self._reported_bad.add(position)
                log.error("train queue entry %d passed over: %s", position, reason)
        return selection if selection.complete else None

    def train_once(self) -> dict[str, float]:
        """Train one step on the next G fresh accepted groups, checkpoint, announce."""
        kept, self._ready_selection = self._ready_selection, None
        selection = kept[1] if kept is not None and kept[0] == self.version else self._select()  # _select once a step
        if selection is None:
            raise RuntimeError("train_once called before a step's groups were queued")
        self.check_alarms()
        self._in_step = True
        self._record_selection(selection)
        if self.ranks is not None:
            self.ranks.send(StepOrder(self.version + 1, tuple(selection.keys)))
        batches = [self.handoff.take(self.store, key) for key in selection.keys]  # in memory, else read from S3
        metrics = train_version(self.trainer, batches)  # see the module docstring: the version moves on
        if metrics.get("alarm"):
            alarm = self.settings.trainer.logprob_alarm
            log.error("step %d applied no update: logprob alarm (on-policy mean |dlogprob| %.3g, max %g; mismatch KL "
                      "%.3g, max %g)", self.version + 1, metrics["logprob_mad_on_policy"], alarm.max_on_policy_mad,
                      metrics["mismatch_kl_on_policy"], alarm.max_on_policy_mismatch_kl)
            self._write(lambda tx: self.counters.add(TrainerCounter.alarm_skipped_steps, transaction=tx))
        version = self.version + 1
        # before the checkpoint, which keeps them: a trainer dying between its commit and this
        # step's metrics line logs the line from there when it restarts (``_log_a_line_lost``)
        metrics |= self._rollout_metrics(batches, selection, trained_at=version - 1)
        t0 = time.perf_counter()
        datasets = RunRecords(self.redis, self.run_id).dataset_versions()
        if self.publisher is not None:
            metrics |= self.publisher.publish(version, self.trainer.model, self.tokenizer, self.trainer.optimizer,
                                              self.trainer.step, datasets, announce=self._announce)
        elif self.ranks is not None:
            self.ranks.save_checkpoint(self.store, self.run_id, version, self.trainer, self.tokenizer, datasets)
            self._announce(version)
        else:
            # the checkpoint and the delta chain carry the same probe, computed once
            probe = logprob_probe(self.trainer.model, version) if self.delta is not None else None
            save_checkpoint(self.store, self.run_id, version, self.trainer.model, self.tokenizer,
                            self.trainer.optimizer, self.trainer.step, dataset_versions=datasets,
                            lora_sync=self.settings.trainer.lora.sync, probe=probe,
                            step_metrics={k: finite_or_none(v) for k, v in metrics.items()})
            if self.delta is not None and probe is not None:
                metrics |= self.delta.publish(version, self.trainer.model, probe.to_json().decode())
            self._announce(version)
        checkpoint_s = time.perf_counter() - t0
        self._in_step = False
        self.version = version
        self.budget.advance_step(version, self.run_marker)
        metrics["checkpoint_s"] = checkpoint_s
        if not (metrics.get("replayed") and self.metrics.logged(version)):  # one line per step, replays included
            self.metrics.log(version, metrics)
            self._record_step(version, metrics)
        self.reward_curve.step_ended()  # behind the step by default: the consumer reads the next step's groups meanwhile
        now = time.time()
        wall = now - self._last_step_at if self._last_step_at else None  # step 1 has no step before it
        self._last_step_at = now
        log.info("step %d: reward %.3f loss %.4f | train %.2fs, %s tokens/s | %s since the last step, %s trajectories/s",
                 version, metrics["reward_mean"], metrics["loss"], metrics["step_time_s"], show(metrics["tokens_per_s"], ".0f"),
                 show(wall, ".1f", "s"), show(per_second(metrics["sequences"], wall)))
        self.evaluate_if_due()
        return metrics

    def _log_a_line_lost(self, version: int) -> None:
        """The resumed version's metrics line, from its checkpoint, if the trainer that wrote the
        checkpoint died before it logged the line (one line per step)."""
        if self.metrics.logged(version):
            return
        saved = read_manifest(self.store, checkpoint_prefix(self.run_id, version)).get("step_metrics")
        if saved is None:  # written under torchrun or in the background (nccl): its line is not kept there
            log.warning("step %d has no metrics line, and its checkpoint keeps none", version)
            return
        metrics = {k: math.nan if v is None else v for k, v in saved.items()} | {"recovered": 1.0}
        log.warning("step %d's metrics line was lost with the trainer that wrote its checkpoint: logged from the "
                    "checkpoint", version)
        self.metrics.log(version, metrics)
        self._record_step(version, metrics)

    def _record_step(self, version: int, metrics: dict[str, float]) -> None:
        """The step's metrics on the run's capped steps stream, for the viewer (strict JSON)."""
        line = {"step": version, "time": time.time(), **{k: finite_or_none(v) for k, v in metrics.items()}}
        self._write(lambda tx: StepMetrics(self.redis, self.run_id).append(line, transaction=tx))

    def _record_selection(self, selection: Selection) -> None:
        """Record the step's selection, then begin the step: with ``trainer.admit_before_served``
        the next step's groups are admitted now, and claimed while this step trains (one thread: a
        core is free then) and syncs; they start on its version (a restarted trainer trains this
        step again on the same groups)."""
        step = self.version + 1
        self.train_queue.commit_selection(step, selection.cursor, selection.stale, len(selection.keys),
                                          len(selection.bad), selection.deferred, self.run_marker)
        self.budget.begin_step(step, self.run_marker)

    def _write(self, fill: Callable[[Any], object]) -> None:
        """The loop's writes of the run's records, never into a Redis that lost the run
        (``RunMarker.guarded``: ``RedisDataLost`` stops the trainer instead)."""
        self.run_marker.guarded(fill, TRAINER_STOPS)

    def _announce(self, version: int) -> None:
        """Announce ``version``: its chain version on delta (its checkpoint when the chain lacks it:
        a trainer that died between the two and resumed at ``version``), else its checkpoint."""
        prefix = checkpoint_prefix(self.run_id, version)
        if self.delta is not None and self.delta.has(version):
            prefix = weight_chain_prefix(self.run_id, version)
        announcement = CheckpointAnnouncement(version=version, prefix=prefix)
        self._write(lambda tx: CheckpointAnnouncements(self.redis, self.run_id).announce(announcement, transaction=tx))

    def _rollout_metrics(self, batches: list[TrainingBatch], selection: Selection, trained_at: int) -> dict[str, float]:
        samples = [s for b in batches for s in b.samples]
        trained_rewards = [s.reward for s in samples if s.segment == 0]  # a multi-segment trajectory counts once
        rewards = trained_rewards + selection.dropped_rewards  # every scored sample of the step's groups
        lengths = [sum(s.loss_mask) for s in samples] or [0]
        staleness = Counter(trained_at - s.oldest_policy_version for s in samples)
        counters = self.counters.all()
        sync = self.weight_syncs.last_sync()
        return {
            "reward_mean": statistics.fmean(rewards),
            "reward_std": statistics.pstdev(rewards),
            "reward_mean_trained": statistics.fmean(trained_rewards) if trained_rewards else math.nan,
            "groups_trained": float(len(selection.keys)),
            "groups_dropped_zero_variance": float(selection.dropped - selection.dropped_filtered),
            "groups_dropped_filtered": float(selection.dropped_filtered),
            "groups_deferred": float(len(selection.deferred)),
            "mixing_quota_short": float(selection.quota_short),
            **{f"groups_env_{metric_name(env or 'unknown')}": float(n) for env, n in sorted(Counter(selection.envs).items())},
            "pass_rate": sum(r >= self.settings.trainer.pass_threshold for r in rewards) / len(rewards),
            "response_tokens_mean": statistics.fmean(lengths),
            "response_tokens_max": float(max(lengths)),
            "filtered_zero_variance": float(counters.get(TrainerCounter.groups_zero_variance.value, 0)),
            "filtered_stale": float(counters.get(TrainerCounter.groups_stale.value, 0)),
            "filtered_all_failed": float(counters.get(TrainerCounter.groups_all_failed.value, 0)),
            "filtered_by_filters": float(counters.get(TrainerCounter.groups_filtered.value, 0)),
            "weight_sync_s": sync["seconds"],
            # its parts, for the step's breakdown (bench/loop_speed.py): the checkpoint's download
            # from the store, the replicas' reload, and the served-logprob probe
            "weight_sync_download_s": sync["download_s"], "weight_sync_reload_s": sync["reload_s"],
            "weight_sync_probe_s": sync["probe_s"],
            "served_probe_max_abs_diff": sync["probe_max_abs_diff"],
            **{f"staleness_{lag}": float(n) for lag, n in sorted(staleness.items())},
        }
