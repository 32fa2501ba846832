"""Conveyor's one settings model.

Sources, highest priority first: keyword arguments, environment variables
(``CONVEYOR_`` prefix, ``__`` between nested names, e.g. ``CONVEYOR_ROLLOUT__GROUP_SIZE=8``),
the YAML file named by ``CONVEYOR_CONFIG`` (or passed as ``yaml_file``), then defaults.

Invariant: settings are validated when a service starts. A bad value raises
``SettingsError`` naming the field (``rollout.group_size: Input should be greater than 0``),
never a traceback from deep inside a service.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RedisSettings(Section):
    url: str = "redis://127.0.0.1:6379/0"


class StorageSettings(Section):
    backend: Literal["s3", "local"] = "s3"
    endpoint: str = "127.0.0.1:9000"  # host:port of the S3 server
    access_key: str = "conveyor"
    secret_key: str = "conveyor-secret"
    bucket: str = "conveyor"
    secure: bool = False
    region: str = "us-east-1"
    local_root: Path = Path(".conveyor/objects")  # for backend=local


class InferenceSettings(Section):
    base_url: str = "http://127.0.0.1:8000"
    replica_urls: list[str] = Field(default_factory=list)  # every replica to keep in sync; [] = [base_url]
    weights_dir: Path = Path(".conveyor/weights")  # where the weight follower puts downloaded checkpoints
    model: str = "tiny"  # served model name
    model_path: Path = Path(".conveyor/models/tiny")  # checkpoint dir; the tokenizer comes from here
    max_model_len: int = Field(1024, gt=0)
    dtype: str = "float32"
    port: int = Field(8000, gt=0, lt=65536)
    request_timeout_s: float = Field(120.0, gt=0)
    max_retries: int = Field(3, ge=0)
    startup_timeout_s: float = Field(300.0, gt=0)
    kv_cache_space_gib: int = Field(1, gt=0)  # VLLM_CPU_KVCACHE_SPACE on CPU hosts


class SamplingSettings(Section):
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)


class RolloutSettings(Section):
    group_size: int = Field(4, gt=0)
    max_turns: int = Field(4, gt=0)
    max_tokens_per_turn: int = Field(32, gt=0)
    max_episode_tokens: int = Field(256, gt=0)  # sampled tokens across all turns
    episode_timeout_s: float = Field(600.0, gt=0)
    worker_concurrency: int = Field(32, gt=0)  # Celery thread-pool slots per worker process
    sampling: SamplingSettings = SamplingSettings()


class LedgerSettings(Section):
    lease_ttl_s: float = Field(30.0, gt=0)  # a running trajectory whose lease is older is re-dispatched
    heartbeat_s: float = Field(5.0, gt=0)
    reaper_interval_s: float = Field(5.0, gt=0)
    max_attempts: int = Field(3, gt=0)
    visibility_timeout_s: int = Field(3600, gt=0)  # Celery redelivery of unacked tasks (a backstop)


class IntakeSettings(Section):
    dataset: str = ""  # a .jsonl file or a saved Hugging Face dataset directory
    split: str = "train"
    env_name: str = "guess_number"
    env_config: dict[str, Any] = Field(default_factory=dict)  # e.g. {"reward_fn": "pkg.mod:fn"}
    mode: Literal["sample", "traversal"] = "traversal"
    num_groups: int = Field(8, gt=0)  # groups to dispatch in sample mode
    base_seed: int = 0


class RewardSettings(Section):
    # reward function name -> weight; names are built-ins or "module:function"
    weights: dict[str, float] = Field(default_factory=lambda: {"verifier": 1.0, "format": 0.1})


class LossSettings(Section):
    clip_eps: float = Field(0.2, gt=0, lt=1)  # lower clip: ratio >= 1 - clip_eps
    clip_eps_high: float | None = Field(None, gt=0)  # upper clip (DAPO clip-higher); None: clip_eps
    kl_coef: float = Field(0.0, ge=0)  # k3 penalty to the frozen reference; 0 loads no reference
    aggregation: Literal["token_mean", "seq_mean"] = "token_mean"


class OptimSettings(Section):
    lr: float = Field(1e-6, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0)  # None: no clipping (the norm is still reported)

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        return betas


class BatchingSettings(Section):
    max_seq_len: int = Field(1024, gt=1)  # prompt + completion tokens the trainer keeps
    micro_batch_tokens: int = Field(8192, gt=0)  # padded tokens per forward/backward
    mask_overlong: bool = True  # DAPO: zero the loss mask of stop_reason=max_tokens samples

    @model_validator(mode="after")
    def _one_sample_fits(self) -> "BatchingSettings":
        if self.micro_batch_tokens < self.max_seq_len:
            raise ValueError(
                f"micro_batch_tokens ({self.micro_batch_tokens}) must be >= max_seq_len ({self.max_seq_len})"
            )
        return self


class TrainerSettings(Section):
    # Staleness bound (shared.staleness). None: no training loop, rollouts are not throttled.
    max_off_policy_steps: int | None = Field(None, ge=0)
    groups_per_step: int = Field(4, gt=0)
    max_steps: int | None = Field(None, gt=0)  # the trainer exits after this many optimizer steps
    advantage_eps: float = Field(1e-6, gt=0)
    scale_advantage_by_std: bool = True
    consumer_name: str = "trainer-0"
    block_ms: int = Field(1000, gt=0)
    metrics_path: Path = Path(".conveyor/metrics.jsonl")  # one line per completed group
    step_metrics_path: Path = Path(".conveyor/train_steps.jsonl")  # one line per optimizer step
    reward_curve_path: Path = Path(".conveyor/reward_curve.png")
    pass_threshold: float = 1.0  # a sample "passes" when its reward reaches this
    prometheus_port: int | None = Field(None, gt=0, lt=65536)
    wandb_project: str | None = None
    loss: LossSettings = LossSettings()
    optim: OptimSettings = OptimSettings()
    batching: BatchingSettings = BatchingSettings()


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="CONVEYOR_", env_nested_delimiter="__", extra="forbid"
    )

    run_id: str = Field("run", pattern=r"^[A-Za-z0-9-]+$")  # no "_": it separates id fields
    redis: RedisSettings = RedisSettings()
    storage: StorageSettings = StorageSettings()
    inference: InferenceSettings = InferenceSettings()
    rollout: RolloutSettings = RolloutSettings()
    ledger: LedgerSettings = LedgerSettings()
    intake: IntakeSettings = IntakeSettings()
    rewards: RewardSettings = RewardSettings()
    trainer: TrainerSettings = TrainerSettings()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        yaml_file = os.environ.get("CONVEYOR_CONFIG")
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if yaml_file:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=yaml_file))
        return tuple(sources)


class SettingsError(ValueError):
    """A bad setting, with the field's dotted name in the message."""


def load_settings(yaml_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Validate settings now; raise SettingsError naming each bad field."""
    if yaml_file is not None:
        if not Path(yaml_file).is_file():
            raise SettingsError(f"settings file {yaml_file} does not exist")
        os.environ["CONVEYOR_CONFIG"] = str(yaml_file)
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise SettingsError(f"invalid Conveyor settings: {problems}") from None
