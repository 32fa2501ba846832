"""The training loop: accepted groups -> optimizer step -> checkpoint -> new policy version.

Invariants:
- The policy version is the number of optimizer steps taken; checkpoint ``v`` holds the
  weights after step ``v``. Version 0 is the base model vLLM started with.
- Step ``v + 1`` trains on the next G (``groups_per_step``) groups of the run's append-only
  train queue after cursor ``v``, skipping groups that have become stale by then (oldest
  turn more than ``max_off_policy_steps`` behind ``v``): staleness is checked when a group is
  trained on, not only when it was accepted. The selection is recorded (cursor ``v + 1``, and
  the stale groups counted) in one atomic step before training, and it is a pure function of
  the queue and ``v``, so a restarted trainer re-selects the same groups: none skipped,
  none repeated, none counted twice.
- A step is announced (checkpoints stream) only after its checkpoint is committed, and the
  staleness step advances with it; on start the latest checkpoint is announced again (the
  weight follower ignores versions it already serves).
- A step with no trainable token (all masks zero) still counts as a step: the version moves
  on with unchanged weights, so the queue position stays a function of the version.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections import Counter
from dataclasses import dataclass

from services.trainer.checkpoints import resume, save_checkpoint
from services.trainer.metrics import MetricsSink, plot_reward_curve
from services.trainer.policy import load_policy
from services.trainer.step import PolicyTrainer
from shared.names import RedisKeys, checkpoint_prefix
from shared.schemas import TrainingBatch
from shared.settings import Settings
from shared.staleness import StalenessBudget
from shared.storage import ObjectStore, get_model

log = logging.getLogger(__name__)

# KEYS: train cursor hash, staleness hash, trainer counters ; ARGV: next version, cursor,
# stale groups skipped, groups trained. Applied once per version (HSETNX), so a replayed
# selection after a restart counts nothing twice.
_COMMIT_SELECTION = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], 'filtered', ARGV[3])
  redis.call('HINCRBY', KEYS[3], 'groups_stale', ARGV[3])
  redis.call('HINCRBY', KEYS[3], 'groups_trained', ARGV[4])
end
return 1
"""


@dataclass
class TrainingLoop:
    settings: Settings
    store: ObjectStore
    budget: StalenessBudget
    metrics: MetricsSink

    def __post_init__(self) -> None:
        self.run_id = self.settings.run_id
        self.redis = self.budget.redis
        self.groups_per_step = self.settings.trainer.groups_per_step
        model, self.tokenizer = load_policy(self.settings.inference.model_path)
        trainer = self.settings.trainer
        self.trainer = PolicyTrainer(
            model, pad_token_id=self.tokenizer.pad_token_id or 0, optim=trainer.optim, loss=trainer.loss,
            batching=trainer.batching, temperature=self.settings.rollout.sampling.temperature or 1.0,
        )
        self.version, step = resume(self.store, self.run_id, model, self.trainer.optimizer)
        self.trainer.step = step
        self.budget.advance_step(self.version)
        self._commit_selection = self.redis.register_script(_COMMIT_SELECTION)
        if self.version > 0:
            self._announce(self.version)
        log.info("training loop at version %d (step %d)", self.version, step)

    def done(self) -> bool:
        max_steps = self.settings.trainer.max_steps
        return max_steps is not None and self.version >= max_steps

    def ready(self) -> bool:
        return self._select() is not None

    def _select(self) -> tuple[list[str], int, int] | None:
        """(batch keys, cursor after them, stale groups skipped) for the next step, or None
        while fewer than G fresh groups are queued."""
        cursor = int(self.redis.hget(RedisKeys.train_cursor(self.run_id), str(self.version)) or 0)
        keys: list[str] = []
        stale = 0
        for raw in self.redis.lrange(RedisKeys.train_queue(self.run_id), cursor, -1):
            cursor += 1
            entry = json.loads(raw)
            if self.budget.is_stale(entry["oldest_policy_version"], self.version):
                stale += 1
                continue
            keys.append(entry["key"])
            if len(keys) == self.groups_per_step:
                return keys, cursor, stale
        return None

    def train_once(self) -> dict[str, float]:
        """Train one step on the next G fresh accepted groups, checkpoint, announce."""
        selection = self._select()
        if selection is None:
            raise RuntimeError("train_once called before a step's groups were queued")
        keys, cursor, stale = selection
        self._record_selection(cursor, stale)
        batches = [get_model(self.store, key, TrainingBatch) for key in keys]
        metrics = self.trainer.train_step(batches)
        if metrics.get("skipped"):
            self.trainer.step += 1  # see the module docstring: the version still moves on
        version = self.version + 1
        t0 = time.perf_counter()
        save_checkpoint(self.store, self.run_id, version, self.trainer.model, self.tokenizer, self.trainer.optimizer, self.trainer.step)
        checkpoint_s = time.perf_counter() - t0
        self._announce(version)
        self.version = version
        self.budget.advance_step(version)
        metrics |= self._rollout_metrics(batches, trained_at=version - 1) | {"checkpoint_s": checkpoint_s}
        self.metrics.log(version, metrics)
        plot_reward_curve(self.metrics.jsonl_path, self.settings.trainer.reward_curve_path, f"{self.run_id}: mean reward per step")
        log.info("step %d: reward %.3f loss %.4f (%.2fs)", version, metrics["reward_mean"], metrics["loss"], metrics["step_time_s"])
        return metrics

    def _record_selection(self, cursor: int, stale: int) -> None:
        self._commit_selection(
            keys=[RedisKeys.train_cursor(self.run_id), self.budget.key, RedisKeys.trainer_counters(self.run_id)],
            args=[self.version + 1, cursor, stale, self.groups_per_step],
        )

    def _announce(self, version: int) -> None:
        self.redis.xadd(RedisKeys.checkpoints(self.run_id), {"version": version, "prefix": checkpoint_prefix(self.run_id, version)})

    def _rollout_metrics(self, batches: list[TrainingBatch], trained_at: int) -> dict[str, float]:
        samples = [s for b in batches for s in b.samples]
        rewards = [s.reward for s in samples]
        lengths = [sum(s.loss_mask) for s in samples]
        staleness = Counter(trained_at - s.oldest_policy_version for s in samples)
        counters = {k: float(v) for k, v in self.redis.hgetall(RedisKeys.trainer_counters(self.run_id)).items()}
        sync = self.redis.hgetall(RedisKeys.weight_sync(self.run_id))
        return {
            "reward_mean": statistics.fmean(rewards),
            "reward_std": statistics.pstdev(rewards),
            "pass_rate": sum(r >= self.settings.trainer.pass_threshold for r in rewards) / len(rewards),
            "response_tokens_mean": statistics.fmean(lengths),
            "response_tokens_max": float(max(lengths)),
            "filtered_zero_variance": counters.get("groups_zero_variance", 0.0),
            "filtered_stale": counters.get("groups_stale", 0.0),
            "filtered_all_failed": counters.get("groups_all_failed", 0.0),
            "weight_sync_s": float(sync.get("seconds", "nan")),
            **{f"staleness_{lag}": float(n) for lag, n in sorted(staleness.items())},
        }
