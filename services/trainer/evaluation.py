"""Evaluation during training: the trainer's newest policy on the eval split, pass@k per environment.

Invariants:
- The pass of version ``v`` runs under a run id of its own, ``<run>-eval-v<v>``. Its
  trajectories go to that run's trainer stream, which no training consumer reads, so no eval
  trajectory can reach a training batch. A pass run again (a trainer restarted in the middle
  of one) publishes nothing twice (intake is idempotent per run) and reads the same results.
- Eval rows are the eval split of the training dataset (``intake.splits`` with role eval; the
  training intake must then publish role train, which settings enforce) or every row of
  ``evaluation.dataset``. They are rolled out in traversal mode, ``samples_per_task`` per task,
  with no staleness admission.
- A pass starts once vLLM serves ``v`` (the run's policy version reaches it) or
  ``sync_timeout_s`` passed; the result names the version that was served. Training waits for
  the pass, so the policy does not move under it.
- A pass ends when every eval trajectory is terminal (scored or failed), or ``timeout_s``
  passed, and then with exactly one ``EvalEnd`` per version on the run's eval stream: the end
  signal. Its scored trajectories are moved to consumed, so the eval run's ledger ends exact.
- pass@k is the unbiased estimator ``1 - C(n-c, k) / C(n, k)`` over a task's ``n`` samples,
  ``c`` of them reaching ``trainer.pass_threshold``, averaged over tasks. A failed trajectory
  is a sample that did not pass; its reward counts in no mean.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import redis

from services.intake.datasets import BadRow, Row
from services.intake.limits import PromptLimit
from services.intake.publisher import run_intake
from services.trainer.metrics import metric_name
from shared.state.group_registry import GroupRegistry
from shared.state.ledger import Ledger
from shared.state.eval_ends import EvalEnds
from shared.state.policy_version import PolicyVersion
from shared.state.run_marker import RunMarker
from shared.schemas import EvalEnd, RolloutRequest, ScoredEvent
from shared.settings import Settings, assembling, training
from shared.storage import ObjectStore
from shared.state.trainer_stream import trainer_events

log = logging.getLogger(__name__)

# KEYS: ends hash, eval stream ; ARGV: version, EvalEnd JSON. One end per version, ever.


def eval_run_id(run_id: str, version: int) -> str:
    return f"{run_id}-eval-v{version}"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chance that at least one of k samples drawn without replacement from n, c correct, passes."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per task, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_settings(settings: Settings, version: int) -> Settings:
    """The settings intake uses to publish the pass of ``version``."""
    evaluation = settings.evaluation
    splits = settings.intake.splits.model_copy(update={"role": "all" if evaluation.dataset else "eval"})
    return settings.model_copy(update={
        "run_id": eval_run_id(settings.run_id, version),
        "intake": settings.intake.model_copy(update={"mode": "traversal", "splits": splits}),
        "rollout": settings.rollout.model_copy(update={"group_size": evaluation.samples_per_task}),
        "trainer": assembling(settings.trainer),
    })


@dataclass
class TaskResult:
    env_name: str
    rewards: list[float]  # scored samples
    failed: int


def summarize(tasks: list[TaskResult], samples_per_task: int, ks: list[int], threshold: float) -> dict[str, float]:
    """Mean reward, pass@k, task and failure counts: overall (``eval_*``) and per environment
    (``eval_<env>_*``)."""
    def block(prefix: str, group: list[TaskResult]) -> dict[str, float]:
        rewards = [r for t in group for r in t.rewards]
        out = {f"{prefix}tasks": float(len(group)), f"{prefix}failed": float(sum(t.failed for t in group)),
               f"{prefix}reward_mean": statistics.fmean(rewards) if rewards else math.nan}
        for k in ks:
            if k <= samples_per_task:
                per_task = [pass_at_k(samples_per_task, sum(r >= threshold for r in t.rewards), k) for t in group]
                out[f"{prefix}pass_at_{k}"] = statistics.fmean(per_task) if per_task else math.nan
        return out

    metrics = block("eval_", tasks)
    by_env: dict[str, list[TaskResult]] = defaultdict(list)
    for task in tasks:
        by_env[task.env_name].append(task)
    for env, group in sorted(by_env.items()):
        metrics |= block(f"eval_{metric_name(env or 'unknown')}_", group)
    return metrics


@dataclass
class Evaluator:
    """Runs the pass of a version through the real pipeline and reports it (``evaluate``)."""

    settings: Settings
    client: redis.Redis  # the Redis that holds the run and its eval passes
    store: ObjectStore
    publish: Callable[[list[RolloutRequest]], None]
    rows: list[Row | BadRow]
    dataset_version: str = ""
    prompt_limit: PromptLimit | None = None
    poll_s: float = 0.5

    def __post_init__(self) -> None:
        self.run_id = self.settings.run_id
        self.ledger = Ledger(self.client, self.settings.ledger.dispatch_ttl_s)
        self.ends = EvalEnds(self.client, self.run_id)
        self.marker = RunMarker(self.client, self.run_id, self.store)  # the end is never written into a Redis that lost the run

    def due(self, version: int) -> bool:
        """Version ``v`` is evaluated after every ``every_steps``-th step and after the last one."""
        evaluation, max_steps = self.settings.evaluation, training(self.settings.trainer).max_steps
        if version <= 0:
            return False
        every = evaluation.every_steps is not None and version % evaluation.every_steps == 0
        return every or (evaluation.at_end and max_steps is not None and version == max_steps)

    def ended(self, version: int) -> EvalEnd | None:
        return self.ends.get(version)

    def evaluate(self, version: int) -> EvalEnd:
        """Publish the pass of ``version``, wait until every eval trajectory is accounted for (or
        the timeout), send the end signal and return it. A version already ended is returned as is."""
        done = self.ended(version)
        if done is not None:
            return done
        evaluation = self.settings.evaluation
        started = time.monotonic()
        served = self._wait_for_served(version, evaluation.sync_timeout_s)
        settings = eval_settings(self.settings, version)
        run = settings.run_id
        report = run_intake(settings, self.rows, self.client, self.publish, store=self.store,
                            dataset_version=self.dataset_version, prompt_limit=self.prompt_limit)
        log.info("eval pass %s of version %d (served %d): %d tasks, %d trajectories published", run, version, served,
                 report.groups, report.trajectories)
        timed_out = not self._wait_terminal(run, started + evaluation.timeout_s)
        tasks, scored, failed = self._results(run)
        metrics = summarize(tasks, evaluation.samples_per_task, evaluation.pass_k, self.settings.trainer.pass_threshold)
        metrics |= {"eval_seconds": time.monotonic() - started, "eval_served_version": float(served),
                    "eval_timed_out": float(timed_out)}
        end = EvalEnd(run_id=self.run_id, eval_run_id=run, policy_version=version, served_version=served,
                      tasks=len(tasks), trajectories=sum(self.ledger.counts(run).values()), scored=scored, failed=failed,
                      timed_out=timed_out, metrics={k: v for k, v in metrics.items() if math.isfinite(v)})
        if not self.ends.end_once(end, self.marker):
            return self.ended(version) or end  # another trainer ended this version first
        log.info("eval of version %d ended: %s", version,
                 ", ".join(f"{k} {v:.3f}" for k, v in sorted(end.metrics.items()) if "_pass_at_" in k or k.endswith("reward_mean")))
        return end

    def _wait_for_served(self, version: int, timeout_s: float) -> int:
        policy, deadline = PolicyVersion(self.client, self.run_id), time.monotonic() + timeout_s
        while (served := policy.get()) < version and time.monotonic() < deadline:
            time.sleep(self.poll_s)
        if served < version:
            log.warning("eval of version %d: vLLM still serves version %d after %.0fs; evaluating what it serves",
                        version, served, timeout_s)
        return served

    def _wait_terminal(self, run: str, deadline: float) -> bool:
        while True:
            counts = self.ledger.counts(run)
            if counts["queued"] + counts["running"] + counts["uploaded"] == 0:
                return True
            if time.monotonic() >= deadline:
                log.error("eval pass %s timed out with %s", run, counts)
                return False
            time.sleep(self.poll_s)

    def _results(self, run: str) -> tuple[list[TaskResult], int, int]:
        """Per task: the rewards of its scored samples and its failures, from the eval run's
        trainer stream (first event per trajectory); scored samples move to consumed."""
        registrations = GroupRegistry(self.client, run).registrations()
        seen: set[str] = set()
        rewards: dict[int, list[float]] = defaultdict(list)
        failures: dict[int, int] = defaultdict(int)
        for _, event in trainer_events(self.client, run):
            if event.trajectory_id in seen:
                continue
            seen.add(event.trajectory_id)
            if isinstance(event, ScoredEvent):
                rewards[event.group_id].append(event.reward)
                self.ledger.mark_consumed(event.trajectory_id)
            else:
                failures[event.group_id] += 1
        tasks = [TaskResult(env_name=reg.env_name, rewards=rewards[group_id], failed=failures[group_id])
                 for group_id, reg in sorted(registrations.items())]
        return tasks, sum(len(r) for r in rewards.values()), sum(failures.values())
