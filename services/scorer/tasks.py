"""Celery entry point of the scorer: ``celery -A services.scorer.tasks worker -Q scoring``.

Invariants:
- Scoring is idempotent by trajectory id: only an ``uploaded`` trajectory is scored; a
  redelivered task finds it ``scored`` (or later) and does nothing.
- The ScoredTrajectory is written to storage before the ledger moves to ``scored``, and that
  move appends the trainer event atomically: the trainer sees each trajectory once.
- A reward function that fails, or a trajectory object that cannot be read, fails the
  trajectory with the reason; the worker goes on.
"""

from __future__ import annotations

import logging
import time

from services.scorer.rewards import RewardCombiner, RewardError
from shared.celery_app import make_celery
from shared.ledger import Ledger
from shared.names import SCORING_TASK, scored_key
from shared.schemas import ScoredTrajectory, TrainerEvent, Trajectory, TrajectoryState
from shared.settings import load_settings
from shared.storage import StorageError, get_model, open_store, put_model

log = logging.getLogger(__name__)
settings = load_settings()
app = make_celery(settings)
_ledger = Ledger.from_url(settings.redis.url)
_store = open_store(settings.storage)
_combiner = RewardCombiner(settings.rewards.weights, settings.rollout.max_episode_tokens)  # a bad reward config fails at start


@app.task(name=SCORING_TASK)
def score_trajectory(trajectory_id: str, key: str, upload_s: float = 0.0) -> str:
    started = time.perf_counter()
    state = _ledger.state(trajectory_id)
    if state != TrajectoryState.uploaded.value:
        log.info("skip scoring %s: it is %s", trajectory_id, state)
        return f"skipped:{state}"
    try:
        trajectory = get_model(_store, key, Trajectory)
        reward, components = _combiner.score(trajectory)
    except (StorageError, RewardError, ValueError) as exc:
        _ledger.fail(trajectory_id, f"scoring_error: {exc}")
        log.error("scoring %s failed: %s", trajectory_id, exc)
        return "failed"
    request = trajectory.request
    timings = trajectory.timings
    scored = ScoredTrajectory(
        trajectory_id=trajectory_id, run_id=request.run_id, group_id=request.group_id,
        trajectory_key=key, reward=reward, components=components, stop_reason=trajectory.stop_reason,
        scored_at=time.time(),
        timings={
            "queue_wait": timings.queue_wait_s, "episode": timings.episode_s, "inference": timings.inference_s,
            "env": timings.env_s, "upload": upload_s, "scoring": time.perf_counter() - started,
        },
    )
    out_key = scored_key(request.run_id, request.group_id, trajectory_id)
    put_model(_store, out_key, scored)
    event = TrainerEvent(
        kind="scored", trajectory_id=trajectory_id, run_id=request.run_id, group_id=request.group_id,
        reward=reward, scored_key=out_key, at=time.time(),
    )
    moved = _ledger.mark_scored(trajectory_id, event)
    return "scored" if moved.ok else f"skipped:{moved.state}"
