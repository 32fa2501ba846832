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
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings import SettingsError as SourceError

from shared.import_path import import_callable
from shared.settings_sources import CheckedDotEnv, CheckedEnv, CheckedYaml, SettingsError  # noqa: F401 (callers import it from here)


def _not_a_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    return value


# Numbers that refuse booleans: pydantic's lax mode would read YAML `true` as 1.
Int = Annotated[int, BeforeValidator(_not_a_bool)]
Float = Annotated[float, BeforeValidator(_not_a_bool)]
# A path kept as written (Path would drop a leading "./"), or a Hugging Face model name.
PathOrName = Annotated[str, BeforeValidator(lambda v: os.fspath(v) if isinstance(v, os.PathLike) else v)]


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
    # a checkpoint directory or a Hugging Face model name (org/name); the tokenizer comes from
    # it too. Which one is decided where it is used (shared.model_source)
    model_path: PathOrName = ".conveyor/models/tiny"
    max_model_len: Int = Field(1024, gt=0)
    dtype: str = "float32"
    port: Int = Field(8000, gt=0, lt=65536)
    host: str = "127.0.0.1"  # the interface a launched vLLM listens on (0.0.0.0 in a container)
    request_timeout_s: Float = Field(120.0, gt=0)
    max_retries: Int = Field(3, ge=0)
    startup_timeout_s: Float = Field(300.0, gt=0)
    kv_cache_space_gib: Int = Field(1, gt=0)  # VLLM_CPU_KVCACHE_SPACE on CPU hosts
    # vLLM without torch.compile or CUDA graphs (--enforce-eager). On CPU with the tiny model it
    # serves in 0.37x the start-up time and decodes at 0.63x the rate (bench/vllm_startup.py):
    # right for short runs and demos, wrong for long ones
    eager: bool = False
    gpu_memory_utilization: Float = Field(0.85, gt=0, le=1)  # GPU hosts: vLLM's share of each GPU's memory
    tensor_parallel_size: Int = Field(1, gt=0)  # GPU hosts: GPUs one vLLM server shards the model over
    # After every weight sync, each replica must reproduce the trainer's logprobs of a fixed
    # sequence (services.policy.probe) within the tolerance, or the sync fails and the served
    # version does not move. None: 1e-4 for float32, 5e-2 for lower precisions.
    sync_probe: bool = True
    sync_probe_tolerance: Float | None = Field(None, gt=0)
    # How new weights reach the replicas. s3: the trainer writes a checkpoint, the weight
    # follower downloads and reloads it. nccl: the trainer broadcasts them GPU to GPU through a
    # process group the replicas join (services.weights.broadcast), and the S3
    # checkpoint is written in the background as the durable record. nccl needs CUDA on the
    # trainer and the replicas: the trainer refuses to start without it. nccl with trainer.lora
    # is refused here (Settings): the broadcast carries full weights only.
    weight_sync: Literal["s3", "nccl"] = "s3"
    weight_sync_host: str = "127.0.0.1"  # the trainer's address as the replicas reach it (its group's store)
    weight_sync_port: Int = Field(29531, gt=0, lt=65536)
    # nccl only: every how many versions the trainer writes the S3 checkpoint (the durable
    # record a restart resumes from); the versions between are served by broadcast only.
    # The last version a trainer publishes is always written at shutdown (services.trainer.broadcast_publish).
    weight_sync_checkpoint_every: Int = Field(1, gt=0)

    @model_validator(mode="after")
    def _sparse_checkpoints_need_broadcast(self) -> "InferenceSettings":
        """On the s3 path a version reaches the replicas only through its checkpoint."""
        if self.weight_sync_checkpoint_every > 1 and self.weight_sync != "nccl":
            raise ValueError(f"weight_sync_checkpoint_every is {self.weight_sync_checkpoint_every}, but with "
                             f"weight_sync: {self.weight_sync} every version is served from its checkpoint; "
                             "set it to 1, or use weight_sync: nccl")
        return self


class SamplingSettings(Section):
    temperature: Float = Field(1.0, ge=0)
    top_p: Float = Field(1.0, gt=0, le=1)


class AgentProxySettings(Section):
    """Bounds of the recording proxy (``services.rollout_worker.agents.proxy``) per trajectory's
    session, so that one sandbox cannot starve the worker's other trajectories."""
    # a body over this is refused with 413 before it is read (declared length), or as soon as
    # the bytes read pass it (chunked)
    max_body_bytes: Int = Field(8 * 1024 * 1024, gt=0)
    # bytes of request bodies a session holds at once, over all its connections (read, parsed or
    # waiting for its turn); a body that would pass it is refused with 429
    session_bytes_in_flight: Int = Field(16 * 1024 * 1024, gt=0)
    # connections open at once on a session's socket; one more is closed as soon as it is accepted
    session_connections: Int = Field(16, gt=0)
    # a connection that has not sent a whole request head this long after it opened (or after its
    # last answer) is closed: slow headers, and idle keep-alive connections
    header_timeout_s: Float = Field(15.0, gt=0)
    # the longest pause while a body is read; a body that stalls longer is dropped (408)
    idle_timeout_s: Float = Field(30.0, gt=0)
    # the text of a call's messages and tools, in characters: a longer one is refused (400)
    # before it is tokenized; tokenizing runs in a thread, off the event loop
    max_prompt_chars: Int = Field(1_000_000, gt=0)
    # the worker's cache of rendered initial prompts (chat_tokens.ChatTokens), in bytes of keys
    # and ids; a session's prompts leave it when the session closes
    prompt_cache_bytes: Int = Field(64 * 1024 * 1024, gt=0)


class RolloutSettings(Section):
    group_size: Int = Field(4, gt=0)
    # group redundancy: dispatch group_size + redundancy members, keep the first group_size
    # scored, cancel the rest (failed: superseded). Cuts the tail a slow sandbox adds to a group
    redundancy: Int = Field(0, ge=0)
    max_turns: Int = Field(4, gt=0)
    max_tokens_per_turn: Int = Field(32, gt=0)
    max_episode_tokens: Int = Field(256, gt=0)  # sampled tokens across all turns
    episode_timeout_s: Float = Field(600.0, gt=0)
    worker_concurrency: Int = Field(32, gt=0)  # Celery thread-pool slots per worker process
    # after a known infra error, a trajectory is queued again this long after attempt 1,
    # doubling per attempt up to retry_backoff_max_s (services.rollout_worker.runner)
    retry_backoff_s: Float = Field(2.0, ge=0)
    retry_backoff_max_s: Float = Field(30.0, ge=0)
    # on SIGTERM, running episodes get this long to finish; then they are handed back to the
    # queue (no attempt spent). Keep it below the orchestrator's kill timeout (compose: 10 s).
    shutdown_grace_s: Float = Field(5.0, ge=0)
    # a worker sends its scoring messages in batches (services.rollout_worker.scoring_outbox): a
    # batch goes out when its rollout task ends, at scoring_batch_max tasks, or this long after
    # its first task. Should a worker die first, the scoring reaper sends them from the ledger
    # ledger.lease_ttl_s + scoring_linger_s after their upload
    scoring_linger_s: Float = Field(0.25, ge=0)
    scoring_batch_max: Int = Field(64, gt=0)
    # a rollout task's finished trajectories are uploaded together, as one object
    # (services.rollout_worker.upload_outbox): when the task's episodes have all ended, at
    # upload_bundle_max trajectories, or this long after the first; until then each stays
    # running under its lease. upload_bundle_max 1 uploads each trajectory alone
    upload_linger_s: Float = Field(0.25, ge=0)
    upload_bundle_max: Int = Field(64, gt=0)
    sampling: SamplingSettings = SamplingSettings()
    # Agent-driven environments: each trajectory's proxy socket lives in a directory of its own
    # under this one (per worker process), which that trajectory's sandbox mounts. Keep it short:
    # a Unix socket path has at most 107 bytes. The Docker daemon must see it at the same path.
    agent_socket_dir: Path = Path("/tmp/conveyor-agents")
    agent_proxy: AgentProxySettings = AgentProxySettings()


class LedgerSettings(Section):
    lease_ttl_s: Float = Field(30.0, gt=0)  # a running trajectory whose lease is older is re-dispatched
    heartbeat_s: Float = Field(5.0, gt=0)
    reaper_interval_s: Float = Field(5.0, gt=0)
    max_attempts: Int = Field(3, gt=0)
    # Celery redelivers a message unacknowledged this long (a backstop for a worker that died before
    # its first claim; a copy of a task still running is a no-op at the claim). Above lease_ttl_s + reaper_interval_s.
    visibility_timeout_s: Int = Field(300, gt=0)
    # a trajectory waiting to be claimed (queued, or uploaded and sent to scoring) this long has its
    # message sent again (it was lost; a copy of one only waiting is a no-op at the claim); the wait
    # doubles after each re-send, up to 32x (shared.state.ledger)
    dispatch_ttl_s: Float = Field(120.0, gt=0)


class OutageSettings(Section):
    """How a long-running service waits out an outage of Redis or the S3 server (shared.outage)."""

    limit_s: Float = Field(900.0, gt=0)  # down longer than this: the service exits with code 2
    backoff_max_s: Float = Field(2.0, gt=0)  # the longest wait between two tries
    log_every_s: Float = Field(30.0, gt=0)  # while it lasts, one "still waiting" line this often


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

    @field_validator("weights")
    @classmethod
    def _import_paths_import(cls, weights: dict[str, float]) -> dict[str, float]:
        for name in weights:
            if ":" in name:  # the built-ins' names are checked by the scorer (services.scorer.rewards)
                import_callable(name, "reward function")
        return weights


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


class LogprobAlarmSettings(Section):
    """When the trainer and the inference service disagree on the policy (services.trainer.alarm)."""

    # mean |trainer logprob - inference logprob| over tokens sampled by exactly the trainer's
    # weights; fp32 agrees to ~2e-7, a stale output head reached 0.15. None: scaled to the
    # trainer's precision (trainer.dtype): 1e-3 in fp32, 5e-2 in bf16
    max_on_policy_mad: Float | None = Field(None, gt=0)
    # stop: the trainer exits with the cause; skip_step: no update is applied, an error is
    # logged and counted (alarm_skipped_steps), and training goes on
    action: Literal["stop", "skip_step"] = "stop"


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
    # train: the trainer steps on accepted groups, rollouts throttled by max_off_policy_steps;
    # assemble: groups are assembled and recorded, nothing trains and nothing throttles rollouts
    mode: Literal["train", "assemble"] = "assemble"
    # Staleness bound (shared.state.staleness), needed by mode train, ignored by assemble
    max_off_policy_steps: Int | None = Field(None, ge=0)
    groups_per_step: Int = Field(4, gt=0)
    max_steps: Int | None = Field(None, gt=0)  # the trainer exits after this many optimizer steps
    advantage_eps: Float = Field(1e-6, gt=0)
    scale_advantage_by_std: bool = True
    advantage_std: Literal["population", "bessel"] = "population"  # TRL: bessel (torch.std)
    # zero-variance groups: "drop" (no signal; their admission slot is refilled) or "keep"
    # (trained with advantage 0; their tokens count in token_mean, as TRL does)
    zero_variance_groups: Literal["drop", "keep"] = "drop"
    # where a trajectory's reward sits among its tokens (services/trainer/token_rewards.py):
    # terminal = plain GRPO; last_token / distributed place each turn's reward on its tokens
    token_rewards: Literal["terminal", "last_token", "distributed"] = "terminal"
    # a chain that may drop a finished group before training (services/trainer/group_filters.py)
    group_filters: list[str | dict[str, Any]] = Field(default_factory=list)

    @field_validator("group_filters")
    @classmethod
    def _filters_build(cls, specs: list[str | dict[str, Any]]) -> list[str | dict[str, Any]]:
        from services.trainer.group_filters import build_filter

        for spec in specs:
            build_filter(spec)  # ValueError (an ImportPathError too) names the bad entry
        return specs
    # while dropping: how many dropped groups one step may wait for beyond groups_per_step;
    # past it the step trains on the groups it has. None: wait for groups_per_step groups.
    max_extra_groups_per_step: Int | None = Field(None, ge=0)
    # mixing: the least share of each step's groups per environment ({env: share}); a group of an
    # environment past its quota is deferred to a later step, at most mixing_window per step
    min_env_share: dict[str, Float] = Field(default_factory=dict)
    mixing_window: Int = Field(32, ge=0)
    logprob_alarm: LogprobAlarmSettings = LogprobAlarmSettings()

    @model_validator(mode="before")
    @classmethod
    def _mode_of_older_configs(cls, data: Any) -> Any:
        """Configs from before trainer.mode trained when they set a staleness bound: they still do."""
        if isinstance(data, dict) and "mode" not in data and data.get("max_off_policy_steps") is not None:
            return {**data, "mode": "train"}
        return data

    @model_validator(mode="after")
    def _training_is_bounded(self) -> "TrainerSettings":
        if self.mode == "train" and self.max_off_policy_steps is None:
            raise ValueError("mode train needs max_off_policy_steps (the staleness bound, 0: synchronous)")
        return self

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
        if self.logprob_alarm.max_on_policy_mad is None:
            scaled = ALARM_MAD_BY_DTYPE[self.dtype]
            self.logprob_alarm = self.logprob_alarm.model_copy(update={"max_on_policy_mad": scaled})
        return self

    @model_validator(mode="after")
    def _shares_fit_a_step(self) -> "TrainerSettings":
        bad = {env: share for env, share in self.min_env_share.items() if not 0 <= share <= 1}
        if bad:
            raise ValueError(f"min_env_share: every share is between 0 and 1, got {bad}")
        need = sum(math.ceil(share * self.groups_per_step) for share in self.min_env_share.values())
        if need > self.groups_per_step:
            raise ValueError(f"min_env_share asks for {need} groups of a step of {self.groups_per_step} (groups_per_step)")
        return self

    consumer_name: str = "trainer-0"
    block_ms: Int = Field(1000, gt=0)
    metrics_path: Path = Path(".conveyor/metrics.jsonl")  # one line per completed group
    step_metrics_path: Path = Path(".conveyor/train_steps.jsonl")  # one line per optimizer step
    reward_curve_path: Path = Path(".conveyor/reward_curve.png")
    pass_threshold: Float = 1.0  # a sample "passes" when its reward reaches this
    prometheus_port: Int | None = Field(None, gt=0, lt=65536)
    wandb_project: str | None = None
    # torch intra-op threads of the trainer; None: torch's default (every core). Where vLLM and
    # the workers share the CPU, 1 made forward/backward 3-8x faster (bench/training.py --vs-trl)
    torch_threads: Int | None = Field(None, gt=0)
    loss: LossSettings = LossSettings()
    optim: OptimSettings = OptimSettings()
    batching: BatchingSettings = BatchingSettings()


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
    storage: StorageSettings = StorageSettings()
    inference: InferenceSettings = InferenceSettings()
    rollout: RolloutSettings = RolloutSettings()
    ledger: LedgerSettings = LedgerSettings()
    outage: OutageSettings = OutageSettings()
    intake: IntakeSettings = IntakeSettings()
    rewards: RewardSettings = RewardSettings()
    trainer: TrainerSettings = TrainerSettings()
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
        its state dict; a LoRA policy serves merged weights or an adapter instead, which neither
        path knows, so the combination is refused rather than served wrong."""
        if self.trainer.lora.enabled and self.inference.weight_sync == "nccl":
            raise ValueError("inference.weight_sync: nccl does not support trainer.lora (either sync mode); "
                             "use weight_sync: s3 with LoRA")
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
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg'].removeprefix('Value error, ')}" for err in exc.errors()
        )
        raise SettingsError(f"invalid Conveyor settings: {problems}") from None
    except SourceError as exc:  # a source could not parse a value (the checks above catch the known cases)
        raise SettingsError(f"invalid Conveyor settings: {exc}") from None
