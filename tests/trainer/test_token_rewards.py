"""Per-token reward placement and advantages (``trainer.token_rewards``), against hand
computations; and that per-token advantages reach the loss as a [B, T] tensor."""

from __future__ import annotations

import pytest
import torch

from services.trainer.batching import collate, prepare_sample
from services.trainer.token_rewards import place_rewards, token_advantages
from shared.schemas import RolloutRequest, StopReason, TaskProfile, TrainingSample, Trajectory, Turn


def turn(index: int, prompt: int, sampled: int, reward: float) -> Turn:
    return Turn(index=index, prompt_token_ids=[7] * prompt, sampled_token_ids=[9] * sampled, logprobs=[-0.5] * sampled,
                policy_version=0, finish_reason="stop", completion_text="", reward=reward)


def trajectory(*turns: Turn) -> Trajectory:
    task = TaskProfile(task_id="t", env_name="gym", task_data={})
    request = RolloutRequest(run_id="r", group_id=0, episode_index=0, episode_seed=0, trajectory_id="r_0_0_0",
                             group_size=2, task=task, dispatched_at=0.0)
    return Trajectory(request=request, turns=list(turns), stop_reason=StopReason.done, env_reward=1.0)


# two turns: prompt 2 + reply 2 (turn reward 0.2), observation 1 + reply 3 (turn reward 0.4)
TRAJ = trajectory(turn(0, 2, 2, 0.2), turn(1, 1, 3, 0.4))
MASK = TRAJ.flatten().loss_mask  # [0, 0, 1, 1, 0, 1, 1, 1]


def test_terminal_puts_the_whole_reward_on_the_last_sampled_token():
    assert place_rewards(TRAJ, 1.0, "terminal") == [0, 0, 0, 0, 0, 0, 0, 1.0]


def test_last_token_puts_each_turn_reward_on_its_last_token_and_the_rest_at_the_end():
    assert place_rewards(TRAJ, 1.0, "last_token") == pytest.approx([0, 0, 0, 0.2, 0, 0, 0, 0.4 + 0.4])


def test_distributed_spreads_each_turn_reward_over_its_tokens():
    placed = place_rewards(TRAJ, 1.0, "distributed")
    assert placed == pytest.approx([0, 0, 0.1, 0.1, 0, 0.4 / 3, 0.4 / 3, 0.4 / 3 + 0.4])
    assert sum(placed) == pytest.approx(1.0)


def test_token_advantages_are_group_normalised_returns_to_go():
    mean, scale = 0.5, 0.25
    # last_token: returns-to-go on sampled tokens: 1.0, 1.0, 0.8, 0.8, 0.8
    advantages = token_advantages(place_rewards(TRAJ, 1.0, "last_token"), MASK, mean, scale)
    assert advantages == pytest.approx([0, 0, 2.0, 2.0, 0, 1.2, 1.2, 1.2])
    # terminal: every sampled token has the sample's GRPO advantage (1.0 - 0.5) / 0.25
    assert token_advantages(place_rewards(TRAJ, 1.0, "terminal"), MASK, mean, scale) == \
        pytest.approx([0, 0, 2.0, 2.0, 0, 2.0, 2.0, 2.0])


def test_per_token_advantages_reach_the_loss_as_one_row_per_sample():
    flat = TRAJ.flatten()
    per_token = token_advantages(place_rewards(TRAJ, 1.0, "distributed"), MASK, 0.5, 1.0)

    def sample(tid: str, token_advantages):
        return TrainingSample(trajectory_id=tid, token_ids=flat.token_ids, loss_mask=flat.loss_mask,
                              inference_logprobs=flat.inference_logprobs, advantage=0.5, reward=1.0,
                              oldest_policy_version=0, stop_reason=StopReason.done, token_advantages=token_advantages)

    prepared = [prepare_sample(sample("r_0_0_0", per_token), 6), prepare_sample(sample("r_0_1_1", None), 6)]
    batch = collate(prepared, pad_token_id=0)
    assert batch.advantages.shape == (2, 6)  # cut to max_seq_len with the tokens
    assert torch.allclose(batch.advantages[0], torch.tensor(per_token[:6]))
    assert torch.allclose(batch.advantages[1], torch.full((6,), 0.5))  # a sample without: its scalar on every token
