"""Scores uploaded trajectories under scoring leases and hands them to the trainer.

Invariants:
- Scoring is idempotent by trajectory id: only an ``uploaded`` trajectory whose scoring lease
  is free is scored; a redelivered or re-dispatched task finds it ``scored`` (or later), or
  leased by a live scorer, and does nothing.
- The scorer holds the trajectory under a lease (``shared.state.ledger.SCORING``) renewed by the
  process's heartbeat; a message of many tasks has every one claimed before the first is
  scored, so none of them waits on the broker should the scorer die. A scorer killed mid-task stops renewing it; the reaper re-dispatches
  the task with the arguments stored at the claim, so no trajectory waits on the broker.
- Only the lease owner moves the trajectory on: ``mark_scored`` (which appends the trainer
  event atomically) and ``fail`` carry its token, so a scorer presumed dead never delivers a
  second copy. The ScoredTrajectories of a batch are written before those moves, as one object
  per run (a bundle, ``shared.object_bundles``) under a key that carries its first member's
  scoring attempt (``shared.names.scored_bundle_key``), so it is never overwritten by another
  attempt; each member's event names its ref, and the Trajectory's key and stop reason, so the
  trainer reads only the Trajectory.
- A trajectory whose run Redis lost (``shared.state.run_marker``) is refused, with one error line
  per run: nothing of the run is recreated.
- An outage of Redis or of the S3 server is waited out (``shared.outage``), never a failure.
- A scoring message that is not a ``ScoringTask`` is dead-lettered and, when it names a
  trajectory waiting for scoring that no scorer holds, fails it (``reject``).
- The trajectory is read by its ref, an object's or an inline one's (``shared.inline_trajectories``).
- A reward function that fails, or a trajectory object that cannot be read, fails the
  trajectory with the reason; the worker goes on. Anything else (a storage outage on write, a
  bug) raises: the lease runs out and the reaper retries, up to ``max_attempts``.
- Scoring is the same wherever it runs: a caller that still holds a trajectory in memory (the
  rollout worker that uploaded it, ``services.rollout_worker.worker_scoring``) passes it to
  ``score_batch`` instead of the object being read back; the claim, the ScoredTrajectory, its
  bundle and the ledger's moves are this module's, one code path.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Mapping

from shared.scoring.rewards import RewardCombiner, RewardError
from shared.state.dead_letters import DeadLetters
from shared.ids import parse_trajectory_id
from shared.state.leases import LeaseKeeper
from shared.state.ledger import SCORING
from shared.names import scored_bundle_key
from shared.prometheus import SCORING_SECONDS
from shared.schemas import BadMessage, ScoredEvent, ScoredTrajectory, ScoringTask, Trajectory
from shared.inline_trajectories import read_trajectory
from shared.storage import ObjectStore, StorageError, put_bundle

log = logging.getLogger(__name__)


@dataclass
class Scorer:
    store: ObjectStore
    combiner: RewardCombiner
    leases: LeaseKeeper  # of the SCORING stage
    dead_letters: DeadLetters  # where a scoring message that is not a ScoringTask goes

    def score(self, task: ScoringTask) -> str:
        """Returns "scored", "failed" or "skipped:<blocking state>"."""
        return self.score_batch([task])[0]

    def score_batch(self, tasks: list[ScoringTask], in_memory: Mapping[str, Trajectory] | None = None) -> list[str]:
        """Claims every task of a message first (one round trip), then scores them, then hands
        them all on (one round trip). A scorer that dies mid-batch leaves a lease on each one it
        has not handed on, and the reaper re-dispatches each, as it would a message of one.
        ``in_memory``: trajectory id -> the uploaded Trajectory its caller still holds (the
        object under the task's key), scored without reading it back."""
        in_memory = in_memory or {}
        outcomes: list[str] = [""] * len(tasks)
        held: list[tuple[int, str, int]] = []  # (index, token, attempt)
        claims = self.leases.claim_many([(task.trajectory_id, task.model_dump_json()) for task in tasks])
        for index, (task, (token, detail)) in enumerate(zip(tasks, claims)):
            if token is not None:
                held.append((index, token, int(detail)))
            elif detail == "unknown" and self.leases.ledger.run_lost(parse_trajectory_id(task.trajectory_id).run_id):
                outcomes[index] = "refused:redis_data_lost"
            else:
                log.info("skip scoring %s: it is %s", task.trajectory_id, detail)
                outcomes[index] = f"skipped:{detail}"
        try:
            scorings: list[tuple[int, str, int, ScoredTrajectory]] = []  # (index, token, attempt, scored)
            for index, token, attempt in held:
                with SCORING_SECONDS.time():
                    scored = self._score(tasks[index], token, in_memory.get(tasks[index].trajectory_id))
                if isinstance(scored, str):
                    outcomes[index] = scored
                else:
                    scorings.append((index, token, attempt, scored))
            moves = self._write_bundles(scorings)
            moved = self.leases.ledger.mark_scored_many([move for _, move in moves])
            for (index, (trajectory_id, _, _)), result in zip(moves, moved):
                if result.ok:
                    outcomes[index] = "scored"
                else:
                    log.warning("%s: lost the scoring lease before hand-off (%s); this attempt is dropped", trajectory_id, result.state)
                    outcomes[index] = f"skipped:{result.state}"
        finally:  # what was not handed on is no longer renewed: its lease runs out, the reaper re-dispatches it
            for index, _, _ in held:
                self.leases.release(tasks[index].trajectory_id)
        return outcomes

    def _write_bundles(self, scorings: list[tuple[int, str, int, ScoredTrajectory]]) -> list[tuple[int, tuple[str, ScoredEvent, str]]]:
        """One object per run of the batch, holding its ScoredTrajectories, named after its first
        member's scoring attempt (``shared.names.scored_bundle_key``); the moves to make, each
        with its event naming its member."""
        by_run: dict[str, list[tuple[int, str, int, ScoredTrajectory]]] = {}
        for scoring in scorings:
            by_run.setdefault(scoring[3].run_id, []).append(scoring)
        moves: list[tuple[int, tuple[str, ScoredEvent, str]]] = []
        for run_id, members in by_run.items():
            _, _, attempt, first = members[0]
            key = scored_bundle_key(run_id, first.group_id, first.trajectory_id, attempt)
            refs = put_bundle(self.store, key, [scored for *_, scored in members])
            for (index, token, _, scored), ref in zip(members, refs):
                event = ScoredEvent(
                    trajectory_id=scored.trajectory_id, run_id=run_id, group_id=scored.group_id, reward=scored.reward,
                    scored_key=ref, at=time.time(), trajectory_key=scored.trajectory_key, stop_reason=scored.stop_reason,
                )
                moves.append((index, (scored.trajectory_id, event, token)))
        return moves

    def _score(self, task: ScoringTask, token: str, known: Trajectory | None = None) -> ScoredTrajectory | str:
        """Reward the trajectory (``known``, or the object under the task's key); its
        ScoredTrajectory, or the outcome when the trajectory failed here."""
        started = time.perf_counter()
        trajectory_id, key = task.trajectory_id, task.trajectory_key
        try:
            trajectory = known if known is not None else read_trajectory(self.store, self.leases.ledger, key)
            reward, components = self.combiner.score(trajectory)
        except (StorageError, RewardError, ValueError) as exc:
            moved = self.leases.ledger.fail(trajectory_id, f"scoring_error: {exc}", token=token)
            log.error("scoring %s failed: %s", trajectory_id, exc)
            return "failed" if moved.ok else f"skipped:{moved.state}"
        request, timings = trajectory.request, trajectory.timings
        scored = ScoredTrajectory(
            trajectory_id=trajectory_id, run_id=request.run_id, group_id=request.group_id,
            trajectory_key=key, reward=reward, components=components, stop_reason=trajectory.stop_reason,
            scored_at=time.time(),
            timings={
                "queue_wait": timings.queue_wait_s, "episode": timings.episode_s, "inference": timings.inference_s,
                "env": timings.env_s, "upload": task.upload_s, "scoring": time.perf_counter() - started,
            },
        )
        return scored

    def reject(self, error: BadMessage, trajectory_id: object = None) -> str:
        """A scoring message that is not a ``ScoringTask``: logged and dead-lettered; when it names
        a trajectory that waits for scoring with no scorer holding it, that trajectory fails
        with the reason (the ledger accounts for it; ``conveyor retry`` can send it again)."""
        log.error("%s", error)
        ledger = self.leases.ledger
        self.dead_letters.add("queue scoring", error)
        try:
            parse_trajectory_id(str(trajectory_id))
        except ValueError:
            return "rejected:bad_message"
        tid = str(trajectory_id)
        if ledger.state(tid) != "uploaded" or ledger.lease_owner(tid, SCORING):
            return "rejected:bad_message"
        moved = ledger.fail(tid, f"bad_message: {error.problems}")
        return "failed:bad_message" if moved.ok else "rejected:bad_message"
