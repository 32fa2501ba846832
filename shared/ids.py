"""Seeds and ids: how a run's seeds, trajectory ids, row picks and splits are derived.

- ``group_seed = base_seed + group_id``; ``episode_seed = group_seed + episode_index``.
- The environment's ``reset`` gets the group seed (``RolloutRequest.task_seed``): every member
  of a group plays the same task instance, and no two groups of a run share a seed. The
  episode seed only names the trajectory; sampling seeds hash (trajectory id, turn).
- ``trajectory_id = {run}_{group_id}_{episode_index}_{episode_seed}``; run ids contain no "_",
  so a trajectory id parses back into its parts.
- Sample mode picks rows deterministically from the group seed: with replacement
  (``sample_row_index``), or in shuffled epochs (``epoch_row_index``: group ``g`` takes
  position ``g mod n`` of epoch ``g div n``'s permutation, seeded by base seed and epoch, so
  every row is used once per epoch).
- Train/eval splits are hash-based: the same task id always lands in the same split.
"""

from __future__ import annotations

import hashlib
import random
from typing import NamedTuple


def group_seed(base_seed: int, group_id: int) -> int:
    return base_seed + group_id


def episode_seed(base_seed: int, group_id: int, episode_index: int) -> int:
    return group_seed(base_seed, group_id) + episode_index


def trajectory_id(run_id: str, group_id: int, episode_index: int, seed: int) -> str:
    if "_" in run_id:
        raise ValueError(f"run id {run_id!r} must not contain '_' (it separates trajectory id fields)")
    return f"{run_id}_{group_id}_{episode_index}_{seed}"


class TrajectoryIdParts(NamedTuple):
    run_id: str
    group_id: int
    episode_index: int
    episode_seed: int


def parse_trajectory_id(value: str) -> TrajectoryIdParts:
    parts = value.split("_")
    if len(parts) != 4:
        raise ValueError(f"malformed trajectory id {value!r}: expected run_group_episode_seed")
    run, group, episode, seed = parts
    return TrajectoryIdParts(run, int(group), int(episode), int(seed))


def sample_row_index(base_seed: int, group_id: int, num_rows: int) -> int:
    """The dataset row a group uses in sample mode: a pure function of the group seed."""
    if num_rows <= 0:
        raise ValueError("cannot sample from an empty dataset")
    return random.Random(group_seed(base_seed, group_id)).randrange(num_rows)


def weighted_row_index(base_seed: int, group_id: int, rows_by_env: dict[str, list[int]], weights: dict[str, float]) -> int:
    """Sample mode with environment weights: the group's seed draws an environment by its
    weight, then one of that environment's rows. Environments without weight are not drawn."""
    envs = sorted(env for env in rows_by_env if weights.get(env, 0) > 0 and rows_by_env[env])
    if not envs:
        raise ValueError(f"no rows of a weighted environment: weights {weights}, rows of {sorted(rows_by_env)}")
    rng = random.Random(group_seed(base_seed, group_id))
    env = rng.choices(envs, weights=[weights[e] for e in envs])[0]
    return rows_by_env[env][rng.randrange(len(rows_by_env[env]))]


def epoch_permutation(base_seed: int, epoch: int, num_rows: int) -> list[int]:
    """The row order of one epoch in shuffled-epochs sample mode."""
    if num_rows <= 0:
        raise ValueError("cannot sample from an empty dataset")
    order = list(range(num_rows))
    random.Random(f"epoch:{base_seed}:{epoch}").shuffle(order)
    return order


def epoch_row_index(base_seed: int, group_id: int, num_rows: int) -> int:
    """The dataset row a group uses in shuffled-epochs sample mode."""
    if num_rows <= 0:
        raise ValueError("cannot sample from an empty dataset")
    epoch, position = divmod(group_id, num_rows)
    return epoch_permutation(base_seed, epoch, num_rows)[position]


def split_of(task_id: str, eval_fraction: float, salt: str = "conveyor") -> str:
    """'eval' or 'train', stable for a task id across runs and machines."""
    digest = hashlib.sha256(f"{salt}:{task_id}".encode()).digest()
    bucket = int.from_bytes(digest[:8], "big") / 2**64
    return "eval" if bucket < eval_fraction else "train"
