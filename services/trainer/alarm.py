"""The logprob alarm: the trainer refuses to learn from a policy that inference does not serve.

Two signals, both enforced by ``trainer.logprob_alarm`` (action ``stop`` or ``skip_step``):
- **On-policy mismatch** (``PolicyTrainer``): on tokens sampled by exactly the trainer's
  current weights, the mean |trainer logprob - inference logprob| must stay at or below
  ``max_on_policy_mad``, and the step's mismatch KL(behaviour || proximal) there (k3 of
  ``log(proximal / behaviour)``, ``mismatch_kl_on_policy``) at or below
  ``max_on_policy_mismatch_kl``, which weighs a few tokens far off more than the mean does.
  Unset, both thresholds are scaled to ``trainer.dtype`` (``ALARM_MAD_BY_DTYPE``,
  ``ALARM_MISMATCH_KL_BY_DTYPE`` in ``shared.settings``). Off-policy tokens are left out: there
  the difference holds the policy change, by design. The check needs samples of the trainer's
  own version, so it is blind when every sample is off-policy.
- **Served weights** (``ServedWeightsAlarm``): every weight sync checks the trainer's probe
  logprobs on every replica (``services.weights.sync``) and records a failure in the
  run's ``WeightSyncRecord`` (``shared.state.weight_sync_record``). That covers every version, on-policy or not. The trainer reads
  the record while it waits for groups, so a stalled run (admission waits for a version that
  never comes) still stops.

Invariants:
- With ``action=stop`` the alarm raises ``LogprobAlarm`` whose message names the cause and the
  setting; the trainer exits non-zero with it. Nothing is trained past the alarm.
- With ``action=skip_step`` an on-policy breach applies no update (the version still moves
  on, unchanged), and a failed sync is logged once per failed version; both are counted.
"""

from __future__ import annotations

import logging
from typing import Any

from shared.state.policy_version import PolicyVersion
from shared.state.run_marker import TRAINER_STOPS, RunMarker
from shared.settings import LogprobAlarmSettings
from shared.state.trainer_counters import TrainerCounter, TrainerCounters
from shared.state.weight_sync_record import WeightSyncRecord

log = logging.getLogger(__name__)


class LogprobAlarm(RuntimeError):
    """The trainer and the inference service disagree on the policy."""


ON_POLICY_CAUSES = ("Inference does not serve the weights the trainer announced (a weight sync that did not take), "
                    "or sampling settings differ between them (temperature, top_p).")


def on_policy_message(mad: float, threshold: float) -> str:
    return (f"logprob alarm: on tokens sampled by the trainer's own weights, trainer and inference logprobs differ "
            f"by {mad:.3g} on average (> trainer.logprob_alarm.max_on_policy_mad = {threshold:g}). {ON_POLICY_CAUSES}")


def on_policy_breach(mad: float, mismatch_kl: float, settings: LogprobAlarmSettings) -> str | None:
    """The alarm's message when an on-policy signal is past its threshold (thresholds set:
    ``LogprobAlarmSettings.scaled_to``), else None. NaN (no on-policy token) never fires."""
    mad_max, kl_max = settings.max_on_policy_mad, settings.max_on_policy_mismatch_kl
    if mad_max is None or kl_max is None:
        raise ValueError("the logprob alarm's thresholds are unset: LogprobAlarmSettings.scaled_to(dtype) sets them")
    if mad > mad_max:
        return on_policy_message(mad, mad_max)
    if mismatch_kl > kl_max:
        return (f"logprob alarm: on tokens sampled by the trainer's own weights, the mismatch KL(behaviour || "
                f"proximal) is {mismatch_kl:.3g} (> trainer.logprob_alarm.max_on_policy_mismatch_kl = {kl_max:g}; "
                f"mean |dlogprob| {mad:.3g}). {ON_POLICY_CAUSES}")
    return None


class ServedWeightsAlarm:
    """Reads the weight follower's failure record for the run and applies the alarm's action."""

    def __init__(self, redis: Any, run_id: str, settings: LogprobAlarmSettings, marker: RunMarker | None = None):
        self.redis, self.run_id, self.settings = redis, run_id, settings
        self.marker = marker or RunMarker(redis, run_id)  # its count is never written into a Redis that lost the run
        self.weight_syncs = WeightSyncRecord(redis, run_id)
        self.served = PolicyVersion(redis, run_id)
        self.counters = TrainerCounters(redis, run_id)
        self._reported: set[int] = set()

    def check(self) -> bool:
        """True when the newest failed sync is above the served version (the alarm fired)."""
        failure = self.weight_syncs.last_failure()
        if failure is None:
            return False
        served = self.served.get()
        version, phase, error = failure.version, failure.phase, failure.error
        if version <= served:
            return False  # a later sync of that version (or a newer one) took
        message = (f"logprob alarm: the weight sync to version {version} did not take ({phase}); inference still "
                   f"serves version {served}. {error}")
        if self.settings.action == "stop":
            raise LogprobAlarm(message)
        if version not in self._reported:
            self._reported.add(version)
            log.error("%s (trainer.logprob_alarm.action=skip_step: training goes on)", message)
            self.marker.guarded(lambda tx: self.counters.add(TrainerCounter.alarm_failed_syncs, transaction=tx),
                                TRAINER_STOPS)
        return True
