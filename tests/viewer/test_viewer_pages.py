"""The run page's plots from step-metric lines, without a browser."""

from __future__ import annotations

from services.viewer.pages import run_page


def test_the_run_page_plots_the_off_policy_mismatch() -> None:
    steps = [{"step": i, "time": float(i), "sequences": 4.0, "reward_mean": 0.5, "mismatch_kl": 0.01 * i,
              "mismatch_ratio_p05": 0.9, "mismatch_ratio_p50": 1.0, "mismatch_ratio_p95": 1.1,
              "correction_masked_frac": 0.0} for i in range(1, 4)]
    page = run_page("run", {"consumed": 3}, steps, [], {})
    assert "proximal / behaviour ratio (quantiles)" in page and "mismatch KL and corrected share" in page
    assert "ratio_p95" in page and "correction_masked_frac" in page
