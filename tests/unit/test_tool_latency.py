"""The simulated tool latency of ``env_config`` (``shared.environments.protocol.EnvConfig``): a
fixed ``step_latency_s``, or a seeded lognormal draw per step with ``step_latency_p99_s``."""

from __future__ import annotations

import statistics

import pytest

from services.rollout_worker.environments.guess_number import GuessNumberEnv
from services.rollout_worker.environments.main_thread import on_main_thread
from shared.environments import EnvironmentConfigError


def draws(env: GuessNumberEnv, n: int) -> list[float]:
    return [env.tool_latency_s() for _ in range(n)]


def test_a_fixed_latency_without_a_p99():
    assert draws(GuessNumberEnv({"step_latency_s": 0.25}), 3) == [0.25, 0.25, 0.25]
    assert GuessNumberEnv({}).tool_latency_s() == 0.0


def test_lognormal_draws_have_the_configured_median_and_p99():
    env = GuessNumberEnv({"step_latency_s": 1.0, "step_latency_p99_s": 20.0})
    env.seed_tool_latency(7)
    values = sorted(draws(env, 20000))
    assert statistics.median(values) == pytest.approx(1.0, rel=0.05)
    assert values[int(0.99 * len(values))] == pytest.approx(20.0, rel=0.15)
    assert min(values) > 0


def test_draws_are_seeded_per_trajectory():
    config = {"step_latency_s": 1.0, "step_latency_p99_s": 20.0}
    first, again, other = GuessNumberEnv(config), GuessNumberEnv(config), GuessNumberEnv(config)
    first.seed_tool_latency("run_3_0_3")  # a trajectory id, as the episode runner passes it
    again.seed_tool_latency("run_3_0_3")
    other.seed_tool_latency("run_3_1_4")
    assert draws(first, 5) == draws(again, 5)
    assert draws(first, 5) != draws(other, 5)


def test_the_main_thread_wrapper_seeds_the_environment_that_sleeps():
    config = {"step_latency_s": 1.0, "step_latency_p99_s": 20.0}
    inner, reference = GuessNumberEnv(config), GuessNumberEnv(config)
    on_main_thread(inner).seed_tool_latency(5)
    reference.seed_tool_latency(5)
    assert draws(inner, 3) == draws(reference, 3)


@pytest.mark.parametrize("config", [{"step_latency_p99_s": 20.0}, {"step_latency_s": 2.0, "step_latency_p99_s": 1.0}])
def test_a_p99_needs_a_positive_median_below_it(config):
    with pytest.raises(EnvironmentConfigError, match="step_latency_p99_s"):
        GuessNumberEnv(config)
