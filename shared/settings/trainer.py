"""Settings of the trainer: device and precision, the loss, the optimizer, batching, the logprob
alarm, LoRA, and its mode: ``trainer`` is a union of ``AssembleTrainerSettings`` and
``TrainTrainerSettings`` told apart by ``trainer.mode``; what only a training trainer reads (the
staleness bound, the step's size and mixing, the step metrics) is a field of the train variant.

Part of ``shared.settings`` (its docstring states the invariants every section keeps).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BeforeValidator, Field, field_validator, model_validator

from shared.settings.base import Float, Int, Section
from shared.settings.group_filters import GroupFilterSpec


class LossSettings(Section):
    clip_eps: Float = Field(0.2, gt=0, lt=1)  # lower clip: ratio >= 1 - clip_eps
    clip_eps_high: Float | None = Field(None, gt=0)  # upper clip (DAPO clip-higher); None: clip_eps
    kl_coef: Float = Field(0.0, ge=0)  # k3 penalty to the frozen reference; 0 loads no reference
    # kind grpo only: the other kinds normalise as their paper does (services/trainer/losses.py)
    aggregation: Literal["token_mean", "seq_mean"] = "token_mean"
    # the policy-gradient term (services/trainer/losses.py); clip_eps / clip_eps_high left unset
    # take the kind's defaults (dapo: high 0.28; gspo: 3e-4 / 4e-4; cispo: no lower bound, high 0.28)
    kind: Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo"] = "grpo"
    # the bounded importance weight w = exp(proximal - behaviour) (services/trainer/loss.py):
    # none keeps the ratio against the behaviour (vLLM) logprobs, with no weight
    correction: Literal["none", "tis", "icepop", "seq_mask"] = "none"
    tis_cap: Float = Field(2.0, ge=1)  # tis: w = min(w, tis_cap)
    icepop_band: Float = Field(2.0, gt=1)  # icepop: w = 0 outside [1/band, band]
    seq_mask_band: Float = Field(1.1, gt=1)  # seq_mask: drop a sequence whose geometric-mean w is outside [1/band, band]

    @model_validator(mode="after")
    def _aggregation_is_grpos(self) -> "LossSettings":
        if self.kind != "grpo" and "aggregation" in self.model_fields_set:
            raise ValueError(f"aggregation applies to kind grpo only; kind {self.kind} normalises as its paper does "
                             "(services/trainer/losses.py): leave aggregation unset")
        return self


class OptimSettings(Section):
    lr: Float = Field(1e-6, gt=0)
    betas: tuple[Float, Float] = (0.9, 0.999)
    eps: Float = Field(1e-8, gt=0)
    weight_decay: Float = Field(0.0, ge=0)
    max_grad_norm: Float | None = Field(1.0, gt=0)  # None: no clipping (the norm is still reported)

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        return betas


class BatchingSettings(Section):
    max_seq_len: Int = Field(1024, gt=1)  # prompt + completion tokens the trainer keeps
    micro_batch_tokens: Int = Field(8192, gt=0)  # padded tokens per forward/backward
    mask_overlong: bool = True  # DAPO: zero the loss mask of stop_reason=truncated samples (a cut last reply)

    @model_validator(mode="after")
    def _one_sample_fits(self) -> "BatchingSettings":
        if self.micro_batch_tokens < self.max_seq_len:
            raise ValueError(
                f"micro_batch_tokens ({self.micro_batch_tokens}) must be >= max_seq_len ({self.max_seq_len})"
            )
        return self


ALARM_MAD_BY_DTYPE = {"fp32": 1e-3, "bf16": 5e-2}  # the logprob alarm's default threshold per trainer.dtype
# the alarm's default threshold on KL(behaviour || proximal) over on-policy tokens, per trainer.dtype.
# fp32: the MAD threshold's equivalent for normally distributed differences, (pi / 4) * 1e-3 ** 2
# ~ 8e-7, rounded up (fp32 on CPU measures ~1e-13). bf16: that equivalent of 5e-2 is 2e-3; bf16
# kernels' differences have heavier tails, which raise the KL against the MAD, so 5x headroom
# (not measured here: no GPU run)
ALARM_MISMATCH_KL_BY_DTYPE = {"fp32": 1e-6, "bf16": 1e-2}


class LogprobAlarmSettings(Section):
    """When the trainer and the inference service disagree on the policy (services.trainer.alarm)."""

    # mean |trainer logprob - inference logprob| over tokens sampled by exactly the trainer's
    # weights; fp32 agrees to ~2e-7, a stale output head reached 0.15. None: scaled to the
    # trainer's precision (trainer.dtype): 1e-3 in fp32, 5e-2 in bf16
    max_on_policy_mad: Float | None = Field(None, gt=0)
    # KL(behaviour || proximal) (the step's mismatch_kl, k3 estimate) over the same tokens: it
    # weighs a few tokens far off more than the mean does. None: scaled to trainer.dtype
    # (ALARM_MISMATCH_KL_BY_DTYPE): 1e-6 in fp32, 1e-2 in bf16
    max_on_policy_mismatch_kl: Float | None = Field(None, gt=0)
    # stop: the trainer exits with the cause; skip_step: no update is applied, an error is
    # logged and counted (alarm_skipped_steps), and training goes on
    action: Literal["stop", "skip_step"] = "stop"

    def scaled_to(self, dtype: str) -> "LogprobAlarmSettings":
        """These settings with every unset threshold at its default for the trainer's ``dtype``."""
        unset = {"max_on_policy_mad": ALARM_MAD_BY_DTYPE[dtype], "max_on_policy_mismatch_kl": ALARM_MISMATCH_KL_BY_DTYPE[dtype]}
        return self.model_copy(update={name: value for name, value in unset.items() if getattr(self, name) is None})


LORA_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
VLLM_MAX_LORA_RANK = 512  # the largest --max-lora-rank vLLM 0.32 accepts


class LoraSettings(Section):
    """Train low-rank adapters instead of every weight (``services.trainer.lora``)."""

    enabled: bool = False
    rank: Int = Field(8, gt=0)
    alpha: Float = Field(16.0, gt=0)  # the adapters' deltas are scaled by alpha / rank
    # the names of the linear layers that get an adapter (matched against module names by peft)
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_ATTENTION))
    # what a checkpoint serves: merged = the full Hugging Face weights with the adapters added
    # (the S3 weight path as without LoRA); adapter = only the adapter, which vLLM loads with its
    # LoRA support (launched with --enable-lora) as a new adapter per version
    sync: Literal["merged", "adapter"] = "merged"

    @field_validator("target_modules")
    @classmethod
    def _named_modules(cls, names: list[str]) -> list[str]:
        if not names:
            raise ValueError("name at least one module to adapt, e.g. q_proj")
        blank = [n for n in names if not n.strip()]
        if blank or len(set(names)) != len(names):
            raise ValueError(f"module names must be non-empty and distinct, got {names}")
        return names

    @model_validator(mode="after")
    def _servable_rank(self) -> "LoraSettings":
        if self.sync == "adapter" and self.rank > VLLM_MAX_LORA_RANK:
            raise ValueError(f"rank {self.rank} is above the {VLLM_MAX_LORA_RANK} vLLM serves adapters of; "
                             "use sync: merged for larger ranks")
        return self

    @property
    def served_rank(self) -> int | None:
        """The adapter rank vLLM must be launched to serve, or None when it serves full weights."""
        return self.rank if self.enabled and self.sync == "adapter" else None


class TrainerSettings(Section):
    """What the trainer reads in either mode: how a group is assembled (advantages, filters,
    token rewards), its metrics and consumer, and the policy trainer's own settings (device,
    precision, loss, optimizer, batching, alarm, LoRA), which build a ``PolicyTrainer`` wherever
    one is made (``services.trainer.step.trainer_from_settings``, benches and tests too) and tell
    the inference service the adapter rank it serves (``LoraSettings.served_rank``)."""

    # where and in what precision the trainer computes: auto = cuda when torch sees a GPU;
    # bf16 = autocast forward and backward with float32 master weights and optimizer state
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["fp32", "bf16"] = "fp32"
    activation_checkpointing: bool = False  # recompute activations in backward: less memory, more compute
    # torch.compile each decoder layer (services/trainer/compile.py): fused elementwise kernels,
    # the first step pays the compilation
    compile_layers: bool = False
    # the float32 log-softmax over this many positions at a time, each chunk recomputed in backward
    # (services/policy/model.py): less logits memory, a little more compute. None: all at once
    logprob_chunk_tokens: Int | None = Field(None, gt=0)
    lora: LoraSettings = LoraSettings()
    advantage_eps: Float = Field(1e-6, gt=0)
    scale_advantage_by_std: bool = True
    advantage_std: Literal["population", "bessel"] = "population"  # TRL: bessel (torch.std)
    # zero-variance groups: "drop" (no signal; their admission slot is refilled) or "keep"
    # (trained with advantage 0; their tokens count in token_mean, as TRL does)
    zero_variance_groups: Literal["drop", "keep"] = "drop"
    # where a trajectory's reward sits among its tokens (services/trainer/token_rewards.py):
    # terminal = plain GRPO; last_token / distributed place each turn's reward on its tokens
    token_rewards: Literal["terminal", "last_token", "distributed"] = "terminal"
    # a chain that may drop a finished group before training (services/trainer/group_filters.py);
    # each entry's type is in shared/settings/group_filters.py
    group_filters: list[GroupFilterSpec] = Field(default_factory=list)
    logprob_alarm: LogprobAlarmSettings = LogprobAlarmSettings()

    @model_validator(mode="after")
    def _dr_grpo_unscaled(self) -> "TrainerSettings":
        """Dr. GRPO's advantages are not divided by the group's std: loss.kind dr_grpo sets
        scale_advantage_by_std false, and refuses it set true."""
        if self.loss.kind == "dr_grpo":
            if "scale_advantage_by_std" in self.model_fields_set and self.scale_advantage_by_std:
                raise ValueError("scale_advantage_by_std: loss.kind dr_grpo does not scale advantages by the group's "
                                 "std; set it false or leave it unset")
            self.scale_advantage_by_std = False
        return self

    @model_validator(mode="after")
    def _alarm_scaled_to_precision(self) -> "TrainerSettings":
        self.logprob_alarm = self.logprob_alarm.scaled_to(self.dtype)
        return self

    consumer_name: str = "trainer-0"
    block_ms: Int = Field(1000, gt=0)
    # groups that one read completes are assembled this many at a time (their members' reads, the
    # batch and record writes, the final transaction: services.trainer.consumer); 1: one after another.
    # 8 did not pay on 2 shared cores (docs/performance/loop_speed.md): the assembly is CPU under the GIL
    assembly_threads: Int = Field(1, ge=1)
    # mode train: the most batches the consumer hands to the training loop in memory, sparing the
    # step their read back from S3 (services.trainer.batch_handoff); 0: every batch read from S3
    batches_in_memory: Int = Field(64, ge=0)
    metrics_path: Path = Path(".conveyor/metrics.jsonl")  # one line per completed group
    pass_threshold: Float = 1.0  # a sample "passes" when its reward reaches this
    prometheus_port: Int | None = Field(None, gt=0, lt=65536)
    # torch intra-op threads of the trainer; None: torch's default (every core). Where vLLM and
    # the workers share the CPU, 1 made forward/backward 3-8x faster (bench/training.py --vs-trl)
    torch_threads: Int | None = Field(None, gt=0)
    loss: LossSettings = LossSettings()
    optim: OptimSettings = OptimSettings()
    batching: BatchingSettings = BatchingSettings()


class AssembleTrainerSettings(TrainerSettings):
    """trainer.mode assemble (the default): groups are assembled and recorded, nothing trains and
    nothing throttles rollouts."""

    mode: Literal["assemble"] = "assemble"


class TrainTrainerSettings(TrainerSettings):
    """trainer.mode train: the trainer steps on accepted groups, rollouts throttled by the
    staleness bound (``shared.state.staleness``)."""

    mode: Literal["train"] = "train"
    max_off_policy_steps: Int = Field(ge=0)  # the staleness bound at admission, 0: synchronous
    # the staleness bound at use: a group whose oldest turn is more than this many steps behind the
    # trainer is dropped as stale. None: max_off_policy_steps. Above it, a long-running group admitted
    # inside the bound is trained off-policy instead of thrown away: its tokens were sampled by a policy
    # up to this many steps old, so turn on a correction (loss.correction, with the proximal policy)
    max_staleness_at_use: Int | None = Field(None, ge=0)
    # admit the next step's groups once the trainer begins a step, not once its weights are served:
    # they are published and claimed while it trains and syncs, and the episode waits (before its reset)
    # for the version the bound gave them (RolloutRequest.generate_from_version). Which policy samples a
    # group is the same as without it (shared.state.staleness); off: the rule as before
    admit_before_served: bool = False
    groups_per_step: Int = Field(4, gt=0)
    max_steps: Int | None = Field(None, gt=0)  # the trainer exits after this many optimizer steps
    # while dropping: how many dropped groups one step may wait for beyond groups_per_step;
    # past it the step trains on the groups it has. None: wait for groups_per_step groups.
    max_extra_groups_per_step: Int | None = Field(None, ge=0)
    # mixing: the least share of each step's groups per environment ({env: share}); a group of an
    # environment past its quota is deferred to a later step, at most mixing_window per step
    min_env_share: dict[str, Float] = Field(default_factory=dict)
    mixing_window: Int = Field(32, ge=0)
    step_metrics_path: Path = Path(".conveyor/train_steps.jsonl")  # one line per optimizer step
    reward_curve_path: Path = Path(".conveyor/reward_curve.png")
    # when the PNG is redrawn after a step: behind (a thread of its own; the trainer goes back to
    # reading groups at once), in_step (before the step returns: it held a sync step's next groups
    # unread 0.3-0.6 s under load, docs/performance/loop_speed.md), off (never)
    reward_curve: Literal["behind", "in_step", "off"] = "behind"
    wandb_project: str | None = None

    @model_validator(mode="after")
    def _use_bound_covers_admission(self) -> "TrainTrainerSettings":
        """A group admitted inside max_off_policy_steps may be trained: the bound at use is not lower.
        Above it no correction is forced (loss.correction none trains the old tokens by the clipped
        ratio against their behaviour logprobs alone); the trainer's consumer warns of it at start."""
        use = self.max_staleness_at_use
        if use is not None and use < self.max_off_policy_steps:
            raise ValueError(f"max_staleness_at_use ({use}) must be >= max_off_policy_steps ({self.max_off_policy_steps}): "
                             "a group admitted inside the bound would be dropped at use; leave it unset for the same bound")
        return self

    @model_validator(mode="after")
    def _shares_fit_a_step(self) -> "TrainTrainerSettings":
        bad = {env: share for env, share in self.min_env_share.items() if not 0 <= share <= 1}
        if bad:
            raise ValueError(f"min_env_share: every share is between 0 and 1, got {bad}")
        need = sum(math.ceil(share * self.groups_per_step) for share in self.min_env_share.values())
        if need > self.groups_per_step:
            raise ValueError(f"min_env_share asks for {need} groups of a step of {self.groups_per_step} (groups_per_step)")
        return self


TRAIN_ONLY = frozenset(TrainTrainerSettings.model_fields) - frozenset(AssembleTrainerSettings.model_fields)


def training(trainer: TrainerSettings) -> TrainTrainerSettings:
    """``trainer`` as the train variant; a ValueError where the code of a training trainer is
    given settings of mode assemble (a wiring error: the process builds it in mode train only)."""
    if not isinstance(trainer, TrainTrainerSettings):
        raise ValueError("the training loop needs trainer.mode: train (with trainer.max_off_policy_steps)")
    return trainer


def assembling(trainer: TrainerSettings) -> AssembleTrainerSettings:
    """``trainer`` in mode assemble: the fields both modes share, as they are."""
    shared = {name: getattr(trainer, name) for name in TrainerSettings.model_fields}
    return AssembleTrainerSettings.model_validate({**shared, "mode": "assemble"})


def _read_trainer_mode(value: Any) -> Any:
    """How ``trainer`` reads its mode: a bare string is the mode alone; a mapping without it is
    train when it sets a staleness bound (configs from before trainer.mode trained then, and
    still do), else assemble. In mode assemble the staleness bound is ignored (as before the
    union), and any other train-only field is refused naming the mode it needs."""
    if isinstance(value, str):
        return {"mode": value}
    if not isinstance(value, dict):
        return value
    if "mode" not in value:
        value = {**value, "mode": "train" if value.get("max_off_policy_steps") is not None else "assemble"}
    if value["mode"] == "assemble":
        # the bound is ignored by assemble, as it always was: a config flips its mode alone
        value = {k: v for k, v in value.items() if k != "max_off_policy_steps" and not (k in TRAIN_ONLY and v is None)}
        given = sorted(TRAIN_ONLY & value.keys())
        if given:
            raise ValueError(f"{given[0]} is a setting of trainer.mode train: set trainer.mode: train "
                             "with trainer.max_off_policy_steps (the staleness bound), or leave it unset")
    return value


# mode names the variant (assemble when left out, unless a staleness bound is set): a field of the
# other mode is an error naming it; TrainerSettings holds what both read
TrainerMode = Annotated[Union[AssembleTrainerSettings, TrainTrainerSettings], Field(discriminator="mode"),
                        BeforeValidator(_read_trainer_mode)]
