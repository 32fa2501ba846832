"""Conveyor's one settings model.

Sources, highest priority first: keyword arguments, environment variables
(``CONVEYOR_`` prefix, ``__`` between nested names, e.g. ``CONVEYOR_ROLLOUT__GROUP_SIZE=8``),
a ``.env`` file in the current directory (the same names), the YAML file named by
``CONVEYOR_CONFIG`` (or passed as ``yaml_file``), then defaults.

Invariant: settings are validated when a service starts, and every problem is a
``SettingsError`` with one message naming its place, never a traceback from deep inside a
service: a bad value names the field (``rollout.group_size: Input should be greater than 0``),
an unknown ``CONVEYOR_*`` variable names itself and the closest known name
(``shared.settings_sources``), bad JSON names the variable, bad YAML names the file and line, and
an import path that does not import (``intake.env_config.reward_fn``, a ``module:function`` in
``rewards.weights``) names the setting and the import error. Numbers refuse booleans
(``group_size: true`` is an error, not 1); digits in a string still parse, as env vars need.

A setting with modes (``storage``, ``inference.weight_sync``, ``trainer`` by ``trainer.mode``,
``sandbox.provider``, each entry of ``trainer.group_filters``) is a discriminated union of
sections: a field of another mode is
refused with its place (``storage.local.bucket``), never ignored, and a mode no variant has
names the mode's field (``storage.backend``). Older spellings still read: a mode alone as a
string, a mapping without its mode (the default mode), and flat names a section folds
(``inference.weight_sync_host``, ``shared.settings.base.fold_names``). Cross-field checks remain
only where no type can say it (nccl or delta with LoRA spans two sections; the eval split spans
evaluation and intake).

The sections live by component: ``base``, ``services``, ``inference``, ``rollout``, ``sandbox``, ``intake``,
``trainer``, ``evaluation`` and the ``group_filters`` entries; every name is importable from
``shared.settings`` as before.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)
from pydantic_settings import SettingsError as SourceError

from shared.settings.base import Float, Int, PathOrName, Section  # noqa: F401
from shared.settings.group_filters import GroupFilterSpec  # noqa: F401
from shared.settings.evaluation import EvaluationSettings  # noqa: F401
from shared.settings.inference import DeltaWeightSync, InferenceSettings, NcclWeightSync, S3WeightSync, WeightSync  # noqa: F401
from shared.settings.intake import IntakeSettings, RewardSettings, SplitSettings  # noqa: F401
from shared.settings.rollout import (  # noqa: F401
    AgentProxySettings,
    RolloutSettings,
    SamplingSettings,
)
from shared.settings.sandbox import DockerProviderSettings, DockerTLSSettings, SandboxProviderSettings, SandboxSettings  # noqa: F401
from shared.settings.services import (  # noqa: F401
    LedgerSettings,
    LocalStorageSettings,
    OutageSettings,
    RedisSettings,
    S3StorageSettings,
    StorageSettings,
)
from shared.settings.trainer import (  # noqa: F401
    ALARM_MAD_BY_DTYPE,
    ALARM_MISMATCH_KL_BY_DTYPE,
    LORA_ATTENTION,
    VLLM_MAX_LORA_RANK,
    BatchingSettings,
    LogprobAlarmSettings,
    LoraSettings,
    LossSettings,
    AssembleTrainerSettings,
    OptimSettings,
    TrainerMode,
    TrainerSettings,
    TrainTrainerSettings,
    assembling,
    training,
)
from shared.settings_sources import (  # noqa: F401 (callers import it from here)
    CheckedDotEnv,
    CheckedEnv,
    CheckedYaml,
    SettingsError,
)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="CONVEYOR_", env_nested_delimiter="__", extra="forbid"
    )

    run_id: str = Field("run", pattern=r"^[A-Za-z0-9-]+$")  # no "_": it separates id fields
    # Prometheus endpoint of a long-running service (workers, trainer, inference control
    # plane): None = off. shared.prometheus says what each exposes.
    metrics_port: Int | None = Field(None, gt=0, lt=65536)
    # ``conveyor run submit``: each run's process logs under runs_dir/<run id>/logs (services.cli.run_submit)
    runs_dir: Path = Path(".conveyor/runs")
    # environment plugins, {name: "module:Class"}, on top of the built-ins and the
    # ``conveyor.environments`` entry points (shared.environments.registry)
    environments: dict[str, str] = Field(default_factory=dict)
    redis: RedisSettings = RedisSettings()
    storage: StorageSettings = S3StorageSettings()
    inference: InferenceSettings = InferenceSettings()
    rollout: RolloutSettings = RolloutSettings()
    sandbox: SandboxSettings = SandboxSettings()
    ledger: LedgerSettings = LedgerSettings()
    outage: OutageSettings = OutageSettings()
    intake: IntakeSettings = IntakeSettings()
    rewards: RewardSettings = RewardSettings()
    trainer: TrainerMode = AssembleTrainerSettings()
    evaluation: EvaluationSettings = EvaluationSettings()

    @model_validator(mode="after")
    def _eval_split_not_trained_on(self) -> "Settings":
        """Evaluating the training dataset's eval split needs one, and intake must publish only
        the train split, else eval tasks would be trained on."""
        evaluation, splits = self.evaluation, self.intake.splits
        if evaluation.enabled and not evaluation.dataset:
            if splits.eval_fraction == 0 and not splits.holdout_envs:
                raise ValueError("evaluation: the eval split is empty; set intake.splits.eval_fraction or "
                                 "holdout_envs, or evaluation.dataset")
            if splits.role != "train":
                raise ValueError(f"evaluation: intake.splits.role is {splits.role!r}, so intake would publish the "
                                 "eval split for training too; set it to 'train'")
        return self

    @model_validator(mode="after")
    def _lora_syncs_through_s3(self) -> "Settings":
        """The nccl broadcast sends the model's own parameters and checkpoints a CPU snapshot of
        its state dict; a LoRA policy serves merged weights or an adapter instead, which it does
        not know, so the combination is refused rather than served wrong. The delta chain carries
        a LoRA policy's merged weights (``services.trainer.delta_publish``), not an adapter: an
        adapter version is already smaller than a merged delta and is served beside the previous
        one without a pause (docs/performance/training.md, "LoRA and the delta chain")."""
        lora, mode = self.trainer.lora, self.inference.weight_sync.mode
        if lora.enabled and mode == "nccl":
            raise ValueError("inference.weight_sync: nccl does not support trainer.lora (either sync mode); use "
                             "weight_sync: s3 with LoRA")
        if lora.enabled and mode == "delta" and lora.sync == "adapter":
            raise ValueError("inference.weight_sync: delta does not support trainer.lora.sync: adapter (the chain "
                             "carries merged weights); use trainer.lora.sync: merged, or weight_sync: s3")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, CheckedEnv(settings_cls), CheckedDotEnv(settings_cls)]
        yaml_file = os.environ.get("CONVEYOR_CONFIG")
        if yaml_file:
            if not Path(yaml_file).is_file():
                raise SettingsError(f"settings file {yaml_file} (CONVEYOR_CONFIG) does not exist")
            sources.append(CheckedYaml(settings_cls, yaml_file=yaml_file))
        return tuple(sources)


def _place(error: Any) -> str:
    """The dotted field of a validation error; a mode no variant has names the mode's field
    (``storage.backend``), not only the setting. The trainer's variants share most fields, so
    its mode is left out of the place (``trainer.lora.rank``, not ``trainer.train.lora.rank``)."""
    loc = [str(p) for p in error["loc"]]
    if loc[:1] == ["trainer"] and loc[1:2] in (["assemble"], ["train"]):
        del loc[1]
    if error["type"] == "union_tag_invalid":
        loc.append(str(error["ctx"]["discriminator"]).strip("'"))
    return ".".join(loc)


def load_settings(yaml_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Validate settings now; raise SettingsError naming each bad field."""
    if yaml_file is not None:
        if not Path(yaml_file).is_file():
            raise SettingsError(f"settings file {yaml_file} does not exist")
        os.environ["CONVEYOR_CONFIG"] = str(yaml_file)
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(f"{_place(err)}: {err['msg'].removeprefix('Value error, ')}" for err in exc.errors())
        raise SettingsError(f"invalid Conveyor settings: {problems}") from None
    except SourceError as exc:  # a source could not parse a value (the checks above catch the known cases)
        raise SettingsError(f"invalid Conveyor settings: {exc}") from None
