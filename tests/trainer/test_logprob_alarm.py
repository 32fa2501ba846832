"""The logprob alarm, enforced: on-policy mismatch in the training step, and a failed weight
sync recorded by the follower, against the tiny model and real Redis."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.alarm import LogprobAlarm, ServedWeightsAlarm
from services.policy.model import sequence_logprobs
from services.trainer.step import PolicyTrainer
from shared.names import RedisKeys
from shared.schemas import TrainingBatch
from shared.settings import ALARM_MAD_BY_DTYPE, ALARM_MISMATCH_KL_BY_DTYPE, LogprobAlarmSettings, TrainerSettings


def on_policy_batch(make_batch, model, shift: float, first_token_only: bool = False) -> TrainingBatch:
    """A group whose inference logprobs are the model's own, shifted by ``shift`` nats: what
    inference serving other weights than the trainer's looks like. ``first_token_only``: only
    each sample's first sampled token is off (a few tokens far off, the rest exact)."""
    batch = make_batch(seed=3, model=model, noise=0.0)
    samples = []
    for s in batch.samples:
        ids = torch.tensor([s.token_ids])
        with torch.no_grad():
            own = sequence_logprobs(model, ids, torch.ones_like(ids))[0].tolist()
        first = s.loss_mask.index(1)
        lp = [v - shift if m and (i == first or not first_token_only) else v if m else 0.0
              for i, (v, m) in enumerate(zip(own, s.loss_mask))]
        samples.append(s.model_copy(update={"inference_logprobs": lp}))
    return batch.model_copy(update={"samples": samples})


def params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_agreeing_logprobs_train_normally(tiny_policy, make_batch) -> None:
    model, tok = tiny_policy
    trainer = PolicyTrainer(model, tok.pad_token_id)
    metrics = trainer.train_step([on_policy_batch(make_batch, model, 0.0)])
    assert metrics["alarm"] == 0.0 and metrics["skipped"] == 0.0 and trainer.step == 1
    assert metrics["logprob_mad_on_policy"] < 1e-5


def test_on_policy_mismatch_stops_the_step_before_any_update(tiny_policy, make_batch) -> None:
    model, tok = tiny_policy
    trainer = PolicyTrainer(model, tok.pad_token_id, alarm=LogprobAlarmSettings(max_on_policy_mad=1e-3))
    before = params(model)
    with pytest.raises(LogprobAlarm, match=r"differ by 0\.0[0-9]+ on average .*max_on_policy_mad = 0\.001"):
        trainer.train_step([on_policy_batch(make_batch, model, 0.05)])
    assert trainer.step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, params(model)))


def test_skip_step_applies_no_update_and_reports_the_alarm(tiny_policy, make_batch) -> None:
    model, tok = tiny_policy
    trainer = PolicyTrainer(model, tok.pad_token_id, alarm=LogprobAlarmSettings(max_on_policy_mad=1e-3, action="skip_step"))
    before = params(model)
    metrics = trainer.train_step([on_policy_batch(make_batch, model, 0.05)])
    assert metrics["alarm"] == 1.0 and metrics["skipped"] == 1.0 and trainer.step == 0
    assert metrics["logprob_mad_on_policy"] == pytest.approx(0.05, abs=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(before, params(model)))


def test_the_alarm_reads_the_mismatch_kl_where_the_mean_difference_passes(tiny_policy, make_batch) -> None:
    """One token per sample 1 nat off, the rest exact: the mean |dlogprob| stays under its
    threshold, KL(behaviour || proximal) does not, and the alarm names it."""
    model, tok = tiny_policy
    batch = on_policy_batch(make_batch, model, 1.0, first_token_only=True)
    before = params(model)
    tight = LogprobAlarmSettings(max_on_policy_mad=0.5, max_on_policy_mismatch_kl=1e-3)
    with pytest.raises(LogprobAlarm, match=r"mismatch KL\(behaviour \|\| proximal\) is 0\.[0-9]+ \(> trainer\."
                                           r"logprob_alarm\.max_on_policy_mismatch_kl = 0\.001; mean \|dlogprob\| 0\.[0-9]+\)"):
        PolicyTrainer(model, tok.pad_token_id, alarm=tight).train_step([batch])
    assert all(torch.equal(a, b) for a, b in zip(before, params(model)))
    loose = LogprobAlarmSettings(max_on_policy_mad=0.5, max_on_policy_mismatch_kl=1.0)
    metrics = PolicyTrainer(model, tok.pad_token_id, alarm=loose).train_step([batch])
    tokens = sum(sum(s.loss_mask) for s in batch.samples)
    assert metrics["alarm"] == 0.0
    assert metrics["logprob_mad_on_policy"] == pytest.approx(len(batch.samples) / tokens, rel=1e-3)
    # k3 of log k = +1 on one token per sample, 0 elsewhere
    assert metrics["mismatch_kl_on_policy"] == pytest.approx((math.e - 2) * len(batch.samples) / tokens, rel=1e-3)


def test_the_mismatch_kl_threshold_is_scaled_to_the_dtype() -> None:
    for dtype in ("fp32", "bf16"):
        alarm = TrainerSettings(dtype=dtype).logprob_alarm
        assert alarm.max_on_policy_mismatch_kl == ALARM_MISMATCH_KL_BY_DTYPE[dtype]
        assert alarm.max_on_policy_mad == ALARM_MAD_BY_DTYPE[dtype]
    assert ALARM_MISMATCH_KL_BY_DTYPE["fp32"] < ALARM_MISMATCH_KL_BY_DTYPE["bf16"]
    set_by_user = TrainerSettings(dtype="bf16", logprob_alarm={"max_on_policy_mismatch_kl": 0.5}).logprob_alarm
    assert (set_by_user.max_on_policy_mismatch_kl, set_by_user.max_on_policy_mad) == (0.5, ALARM_MAD_BY_DTYPE["bf16"])


def test_agreeing_fp32_logprobs_stay_far_under_the_default_mismatch_kl(tiny_policy, make_batch) -> None:
    model, tok = tiny_policy
    metrics = PolicyTrainer(model, tok.pad_token_id).train_step([on_policy_batch(make_batch, model, 0.0)])
    assert metrics["alarm"] == 0.0 and metrics["mismatch_kl_on_policy"] < ALARM_MISMATCH_KL_BY_DTYPE["fp32"] / 100


def test_off_policy_samples_do_not_trip_the_on_policy_check(tiny_policy, make_batch) -> None:
    model, tok = tiny_policy
    trainer = PolicyTrainer(model, tok.pad_token_id)
    trainer.step = 5  # the samples (version 0) are 5 versions old: their difference is the policy change
    metrics = trainer.train_step([on_policy_batch(make_batch, model, 0.5)])
    assert metrics["alarm"] == 0.0 and metrics["logprob_mad_on_policy"] != metrics["logprob_mad_on_policy"]  # NaN
    assert metrics["mismatch_kl_on_policy"] != metrics["mismatch_kl_on_policy"]  # NaN: no on-policy token


def record_failed_sync(redis_client, run_id: str, version: int) -> None:
    redis_client.hset(RedisKeys.weight_sync(run_id), mapping={
        "failed_version": version, "failed_phase": "probe", "error": "probe logprobs differ by max 0.25"})


def test_a_failed_sync_above_the_served_version_stops_the_trainer(redis_client, run_id) -> None:
    alarm = ServedWeightsAlarm(redis_client, run_id, LogprobAlarmSettings())
    assert not alarm.check()  # nothing recorded
    record_failed_sync(redis_client, run_id, 1)
    with pytest.raises(LogprobAlarm, match=r"weight sync to version 1 did not take \(probe\); inference still serves "
                                           r"version 0\. probe logprobs differ by max 0\.25"):
        alarm.check()
    redis_client.set(RedisKeys.policy_version(run_id), 1)  # a retry of that version took
    assert not alarm.check()


def test_skip_step_reports_a_failed_sync_once_and_goes_on(redis_client, run_id) -> None:
    alarm = ServedWeightsAlarm(redis_client, run_id, LogprobAlarmSettings(action="skip_step"))
    record_failed_sync(redis_client, run_id, 2)
    assert alarm.check() and alarm.check()
    assert redis_client.hget(RedisKeys.trainer_counters(run_id), "alarm_failed_syncs") == "1"
