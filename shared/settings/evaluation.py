"""Settings of evaluation passes during training.

Part of ``shared.settings`` (its docstring states the invariants every section keeps).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from shared.settings.base import Float, Int, Section


class EvaluationSettings(Section):
    """Evaluation during training (``services.trainer.evaluation``): the policy the trainer has
    just made is rolled out on the eval split, in traversal mode, under a run id of its own."""

    every_steps: Int | None = Field(None, gt=0)  # evaluate after every N-th step; None: never during training
    at_end: bool = True  # and after the last step (trainer.max_steps), when evaluation is on
    # "" : the eval split of intake.dataset (intake.splits); else every row of this dataset is eval
    dataset: str = ""
    samples_per_task: Int = Field(4, gt=0)  # n rollouts per task: pass@k for every k in pass_k up to n
    pass_k: list[Int] = Field(default_factory=lambda: [1])
    sync_timeout_s: Float = Field(300.0, gt=0)  # wait this long for vLLM to serve the version evaluated
    timeout_s: Float = Field(1800.0, gt=0)  # a pass not accounted for by then ends, marked timed out
    metrics_path: Path = Path(".conveyor/eval.jsonl")  # one line per pass; Prometheus and W&B as training's

    @field_validator("pass_k")
    @classmethod
    def _positive_k(cls, ks: list[int]) -> list[int]:
        if any(k < 1 for k in ks):
            raise ValueError(f"every k must be at least 1, got {ks}")
        return sorted(set(ks))

    @model_validator(mode="after")
    def _k_within_samples(self) -> "EvaluationSettings":
        if self.pass_k and self.pass_k[-1] > self.samples_per_task:
            raise ValueError(f"pass@{self.pass_k[-1]} needs samples_per_task >= {self.pass_k[-1]}, "
                             f"got {self.samples_per_task}")
        return self

    @property
    def enabled(self) -> bool:
        return self.every_steps is not None or self.at_end and bool(self.dataset)
