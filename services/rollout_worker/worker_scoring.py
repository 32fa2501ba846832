"""Scores a rollout task's uploaded trajectories in the rollout worker itself, with no scoring
hop, when every configured reward function may run there (``rewards.in_worker: auto`` and each
function declared cheap: ``shared.scoring.rewards.in_worker``). Otherwise nothing changes: the
scoring tasks go to the scorer service in batches (``scoring_outbox``).

Invariants:
- The ledger records what it records for the scorer service, through the same code
  (``shared.scoring.scorer.Scorer.score_batch``): the upload's move comes first (running ->
  uploaded, the scoring task and its send-by entry stored: ``Ledger.mark_uploaded_many``), then
  this process claims the scoring lease (an attempt of the scoring stage), writes the scored
  bundle and moves the trajectory to ``scored`` with its trainer event, or fails it when a
  reward function raises. Only trajectories whose upload move was this attempt's are scored
  here, from the Trajectory just written (not read back).
- A crash loses and duplicates nothing. Before the claim, the send-by entry stands: the scoring
  reaper (in every scorer process) sends the stored task to the scorer once it passes
  (``ledger.lease_ttl_s + rollout.scoring_linger_s`` after the upload). After the claim, this
  process's scoring lease stops being renewed: the reaper re-dispatches the task to the scorer
  once it runs out, and a late move of this process finds the lease gone (``not_owner``). After
  the move, every copy is a no-op at the claim. So the scorer service must run wherever
  trajectories are scored in the worker: its reaper finishes what a dead worker left.
- An error other than the reward's (Redis or the S3 server down past ``outage.limit_s``, a bug)
  never fails the rollout: it is logged, and the tasks go to the scorer as if scored there
  (a copy of one this process still holds is a no-op at the scorer's claim; the lease runs out
  and the reaper sends it again).
- It runs in the upload's thread (blocking calls), after the upload's ledger move.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis

from shared.schemas import ScoringTask, Trajectory
from shared.scoring.rewards import RewardCombiner
from shared.scoring.scorer import Scorer
from shared.settings import Settings
from shared.state.dead_letters import DeadLetters
from shared.state.leases import LeaseKeeper
from shared.state.ledger import SCORING, Ledger
from shared.storage import ObjectStore

log = logging.getLogger(__name__)


@dataclass
class WorkerScoring:
    scorer: Scorer  # over this process's own scoring lease keeper (``SCORING``), renewed by its heartbeat

    def score_uploaded(self, uploaded: list[tuple[Trajectory, ScoringTask | None]]) -> list[ScoringTask | None]:
        """``uploaded``: each trajectory of a bundle with its scoring task, None when the upload's
        move was not its attempt's. Returns, in order, the scoring tasks still to send to the
        scorer: None for each one scored (or failed, or found elsewhere) here."""
        tasks = [task for _, task in uploaded if task is not None]
        if not tasks:
            return [None] * len(uploaded)
        in_memory = {task.trajectory_id: trajectory for trajectory, task in uploaded if task is not None}
        try:
            outcomes = self.scorer.score_batch(tasks, in_memory)
        except Exception:
            log.exception("scoring %d trajectories in the worker (%s, ...) failed; they go to the scorer",
                          len(tasks), tasks[0].trajectory_id)
            return [task for _, task in uploaded]
        for task, outcome in zip(tasks, outcomes):
            log.info("scoring %s in the worker: %s", task.trajectory_id, outcome)
        return [None] * len(uploaded)


def worker_scoring_for(settings: Settings, ledger: Ledger, store: ObjectStore, client: redis.Redis) -> WorkerScoring | None:
    """This process's in-worker scoring, its scoring lease heartbeat started, when the settings
    allow it (``rewards.in_worker: auto``) and every reward function is declared cheap; else None
    (the scorer scores everything); ``client``: the ledger's Redis, for the dead letters. A bad
    reward configuration fails here, at start."""
    if settings.rewards.in_worker == "never":
        return None
    combiner = RewardCombiner(settings.rewards.weights, settings.rollout.max_episode_tokens)
    if combiner.not_in_worker:
        log.info("trajectories are scored on the scorer: reward functions %s are not declared cheap (in_worker)",
                 combiner.not_in_worker)
        return None
    leases = LeaseKeeper(ledger, settings.ledger.lease_ttl_s, settings.ledger.heartbeat_s, SCORING)
    leases.start()
    log.info("trajectories are scored in this worker (rewards.in_worker: auto; %s)", sorted(combiner.functions))
    return WorkerScoring(Scorer(store, combiner, leases, DeadLetters(client)))
