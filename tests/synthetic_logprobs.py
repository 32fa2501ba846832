"""The logprob alarm switched off, for trainer tests whose behaviour logprobs are made up
(``make_batch``'s noise, random ids): both on-policy signals, the mean |dlogprob| and the
mismatch KL, get a bound nothing reaches (``services.trainer.alarm``)."""

from __future__ import annotations

from shared.settings import LogprobAlarmSettings

SYNTHETIC_LOGPROBS = LogprobAlarmSettings(max_on_policy_mad=1e6, max_on_policy_mismatch_kl=1e6)
