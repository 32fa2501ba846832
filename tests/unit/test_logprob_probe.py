"""The logprob probe's sequence, comparison and file format (services.policy.probe)."""

from __future__ import annotations

import math

import pytest

from services.policy.probe import LogprobProbe, compare, default_tolerance, probe_token_ids


@pytest.mark.parametrize("vocab", [2, 7, 512, 32000, 151936])
def test_probe_sequence_is_fixed_in_range_and_spans_the_vocabulary(vocab: int) -> None:
    ids = probe_token_ids(vocab)
    assert ids == probe_token_ids(vocab) and len(ids) == 64
    assert all(0 <= t < vocab for t in ids)
    assert len(set(ids)) == min(vocab, 64)
    if vocab >= 512:
        assert max(ids) - min(ids) > vocab // 2  # reaches far rows of the output head


def test_compare_uses_the_max_difference_and_never_passes_nan() -> None:
    result = compare([-1.0, -2.0, -3.0], [-1.0, -2.00005, -3.0], 1e-4)
    assert result.ok and result.max_abs_diff == pytest.approx(5e-5) and result.mean_abs_diff == pytest.approx(5e-5 / 3)
    assert not compare([-1.0, -2.0], [-1.0, -2.001], 1e-4).ok
    assert not compare([-1.0], [math.nan], 1e-4).ok
    with pytest.raises(ValueError, match="lengths differ"):
        compare([-1.0], [-1.0, -2.0], 1e-4)


def test_probe_round_trips_and_rejects_a_wrong_length() -> None:
    probe = LogprobProbe(version=3, token_ids=[1, 2, 3], logprobs=[-0.5, -1.25])
    assert LogprobProbe.from_json(probe.to_json()) == probe
    with pytest.raises(ValueError, match="needs 2 logprobs"):
        LogprobProbe(version=3, token_ids=[1, 2, 3], logprobs=[-0.5])


def test_tolerance_follows_the_serving_precision() -> None:
    assert default_tolerance("float32") == 1e-4
    assert default_tolerance("bfloat16") > 1e-2
