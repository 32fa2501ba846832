"""GRPO group advantages, checked against hand-computed values."""

from __future__ import annotations

import math

import pytest

from services.trainer.advantages import group_advantages, group_std


def test_hand_computed_group_uses_population_std():
    # rewards 0, 0, 1, 1: mean 0.5, population std 0.5 (sample std would be 0.577...)
    result = group_advantages([0.0, 0.0, 1.0, 1.0], eps=0.0)
    assert result.mean == pytest.approx(0.5)
    assert result.std == pytest.approx(0.5)
    assert result.advantages == pytest.approx([-1.0, -1.0, 1.0, 1.0])
    assert not result.zero_variance


def test_hand_computed_uneven_group():
    # rewards 1, 2, 3, 6: mean 3; deviations -2, -1, 0, 3; var (4+1+0+9)/4 = 3.5
    result = group_advantages([1.0, 2.0, 3.0, 6.0], eps=0.0)
    std = math.sqrt(3.5)
    assert result.mean == pytest.approx(3.0)
    assert result.std == pytest.approx(std)
    assert result.advantages == pytest.approx([-2 / std, -1 / std, 0.0, 3 / std])
    assert sum(result.advantages) == pytest.approx(0.0, abs=1e-12)


def test_eps_is_added_to_the_std():
    result = group_advantages([0.0, 1.0], eps=0.5)
    # mean .5, std .5 -> (r - .5) / (0.5 + 0.5)
    assert result.advantages == pytest.approx([-0.5, 0.5])
    default = group_advantages([0.0, 1.0])
    assert default.advantages == pytest.approx([-0.5 / (0.5 + 1e-6), 0.5 / (0.5 + 1e-6)], rel=1e-12)


def test_without_std_scaling_advantage_is_reward_minus_mean():
    result = group_advantages([1.0, 2.0, 3.0, 6.0], eps=0.5, scale_by_std=False)
    assert result.advantages == pytest.approx([-2.0, -1.0, 0.0, 3.0])
    assert result.std == pytest.approx(math.sqrt(3.5))  # still reported


@pytest.mark.parametrize("rewards", [[0.3, 0.3, 0.3], [1.0], [0.1] * 8, [0.0, 0.0]])
def test_equal_rewards_are_zero_variance(rewards):
    result = group_advantages(rewards)
    assert result.zero_variance
    assert result.advantages == pytest.approx([0.0] * len(rewards), abs=1e-6)


def test_small_but_real_difference_is_not_zero_variance():
    assert not group_advantages([0.0, 0.0, 0.0, 1e-3]).zero_variance


def test_empty_group_is_an_error():
    with pytest.raises(ValueError):
        group_advantages([])


def test_bessel_std_against_hand_computation_and_torch():
    import torch

    rewards = [0.0, 0.25, 1.0]
    # mean 5/12; squared deviations sum (25 + 4 + 49) / 144 = 78/144; / (n - 1) = 2
    assert group_std(rewards, "bessel") == pytest.approx(math.sqrt(78 / 144 / 2))
    assert group_std(rewards, "population") == pytest.approx(math.sqrt(78 / 144 / 3))
    assert group_std(rewards, "bessel") == pytest.approx(float(torch.tensor(rewards).std()))  # TRL's choice
    result = group_advantages(rewards, eps=0.0, std_kind="bessel")
    assert result.advantages == pytest.approx([(r - 5 / 12) / math.sqrt(78 / 144 / 2) for r in rewards])


def test_a_single_member_group_has_zero_std_in_both_kinds():
    assert group_std([0.7], "bessel") == 0.0 and group_std([0.7], "population") == 0.0
    assert group_advantages([0.7], std_kind="bessel").zero_variance
    with pytest.raises(ValueError, match="population or bessel"):
        group_std([0.0, 1.0], "sample")  # type: ignore[arg-type]
