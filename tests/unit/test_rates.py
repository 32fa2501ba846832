"""A rate with no interval is unknown ("-"), never nan, inf or a ZeroDivisionError (issue 24)."""

from __future__ import annotations

import math

import pytest

from shared.rates import per_second, show


@pytest.mark.parametrize("seconds", [None, 0.0, -1.0, math.nan, math.inf])
def test_a_rate_with_no_interval_is_unknown_and_prints_as_a_dash(seconds):
    assert per_second(12, seconds) is None
    assert show(per_second(12, seconds)) == "-"


def test_a_rate_over_an_interval_prints_with_its_spec_and_suffix():
    assert per_second(12, 4.0) == 3.0
    assert show(per_second(12, 4.0)) == "3.0"
    assert show(2.25, ".2f", "s") == "2.25s"
    assert show(math.nan) == "-"
