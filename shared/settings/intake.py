"""Settings of intake: the dataset, how rows become groups, splits, the share of the rollout queue,
and the reward functions.

Part of ``shared.settings`` (its docstring states the invariants every section keeps).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from shared.import_path import import_callable
from shared.settings.base import Float, Int, Section


class SplitSettings(Section):
    """Train/eval assignment of a dataset's tasks (services/intake/splits.py)."""

    role: Literal["all", "train", "eval"] = "all"  # which split this intake publishes
    eval_fraction: Float = Field(0.0, ge=0, le=1)  # per environment
    holdout_envs: list[str] = Field(default_factory=list)  # environments that are eval only
    eval_cap_per_env: Int | None = Field(None, ge=0)
    salt: str = "conveyor"  # change it to draw a different, equally stable split


class IntakeSettings(Section):
    dataset: str = ""  # a .jsonl file or a saved Hugging Face dataset directory
    split: str = "train"
    env_name: str = "guess_number"
    env_config: dict[str, Any] = Field(default_factory=dict)  # e.g. {"reward_fn": "pkg.mod:fn"}
    dataset_label: str = ""  # recorded with the content hash as the dataset version: label@hash
    max_row_bytes: Int = Field(1 << 20, gt=0)  # a larger row is rejected, not read
    splits: SplitSettings = SplitSettings()
    mode: Literal["sample", "traversal"] = "traversal"
    # sample mode: "replacement" draws each group's row from its seed; "shuffled_epochs" visits
    # every row once per epoch, in an order shuffled per epoch from base_seed
    sample_order: Literal["replacement", "shuffled_epochs"] = "replacement"
    num_groups: Int = Field(8, gt=0)  # groups to dispatch in sample mode
    # sample mode, order replacement: draw each group's environment by these weights ({env: w}),
    # then a row of it; only the environments named here are drawn. {}: rows uniformly
    env_weights: dict[str, Float] = Field(default_factory=dict)
    base_seed: Int = 0
    # intake blocked (the staleness bound) says why after this long, then at doubling intervals up to 5 min
    wait_log_every_s: Float = Field(10.0, gt=0)
    # fair share between runs on the same rollout workers (services/intake/queue_share.py): publish a
    # group only while fewer than this many of the run's groups wait unclaimed in the rollout queue.
    # None: publish as fast as rows are read
    max_queued_groups: Int | None = Field(None, gt=0)
    # the groups admitted at one time are registered, then published together, at most this many
    # (services/intake/publisher.py's PublishBurst); 1, the default: each group published as soon as
    # it is admitted. Opt-in: on 2 cores it cut a step's dispatch spread from 20-24 ms to 3-4 ms but
    # not the last group's start (the worker receives the tasks one by one) (docs/performance/loop_speed.md)
    publish_burst: Int = Field(1, gt=0)

    @field_validator("env_config")
    @classmethod
    def _reward_fn_imports(cls, env_config: dict[str, Any]) -> dict[str, Any]:
        if "reward_fn" in env_config:
            import_callable(str(env_config["reward_fn"]), "reward_fn")
        return env_config

    @model_validator(mode="after")
    def _weights_draw_something(self) -> "IntakeSettings":
        if not self.env_weights:
            return self
        if any(w < 0 for w in self.env_weights.values()) or not any(w > 0 for w in self.env_weights.values()):
            raise ValueError(f"env_weights: weights are >= 0 and one at least is > 0, got {self.env_weights}")
        if self.mode == "sample" and self.sample_order != "replacement":
            raise ValueError("env_weights draws with replacement: set sample_order to 'replacement'")
        return self


class RewardSettings(Section):
    # reward function name -> weight; names are built-ins or "module:function"
    weights: dict[str, Float] = Field(default_factory=lambda: {"verifier": 1.0, "format": 0.1})
    # where trajectories are scored: "auto", in the rollout worker that uploaded them, with no
    # scoring hop, when every function of ``weights`` is declared cheap (shared.scoring.rewards:
    # in_worker), else on the scorer; "never", always on the scorer. Either way the scorer
    # service runs: its reaper finishes what a worker that died mid-scoring left.
    in_worker: Literal["auto", "never"] = "never"

    @field_validator("weights")
    @classmethod
    def _import_paths_import(cls, weights: dict[str, float]) -> dict[str, float]:
        for name in weights:
            if ":" in name:  # the built-ins' names are checked by the scorer (shared.scoring.rewards)
                import_callable(name, "reward function")
        return weights
