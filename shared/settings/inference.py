"""Settings of the inference service: the model vLLM serves, how it is launched, and how weights
reach it.

Part of ``shared.settings`` (its docstring states the invariants every section keeps).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import Field, model_validator

from shared.settings.base import Float, Int, PathOrName, Section, fold_names, read_mode


class S3WeightSync(Section):
    """The trainer writes a checkpoint of every version; the weight follower downloads it and
    reloads the replicas (``services.weights.follower``)."""

    mode: Literal["s3"] = "s3"


class NcclWeightSync(Section):
    """The trainer broadcasts each version from its memory through a process group the replicas
    join (``services.weights.broadcast``), and writes the S3 checkpoint in the background as the
    durable record. ``backend: nccl`` (GPU to GPU) needs CUDA on the trainer and the replicas:
    the trainer refuses to start without it. ``backend: gloo`` sends CPU tensors over TCP, for
    replicas on CPU hosts, or co-located with the trainer, that can reach its ``host:port``."""

    mode: Literal["nccl"] = "nccl"
    backend: Literal["nccl", "gloo"] = "nccl"
    host: str = "127.0.0.1"  # the trainer's address as the replicas reach it (its group's store)
    port: Int = Field(29531, gt=0, lt=65536)
    # every how many versions the trainer writes the S3 checkpoint (the durable record a restart
    # resumes from); the versions between are served by broadcast only. The last version a
    # trainer publishes is always written at shutdown (services.trainer.broadcast_publish)
    checkpoint_every: Int = Field(1, gt=0)
    # one broadcast carries at most this many MiB of consecutive tensors of one dtype
    # (services.weights.broadcast.bucket_layout; a larger tensor goes alone); the trainer holds one
    # bucket's copy at a time. 0: one broadcast per tensor
    bucket_mib: Int = Field(256, ge=0)


class DeltaWeightSync(Section):
    """The trainer writes its checkpoint as on s3 (the durable record) and publishes each version
    to the run's delta chain in the served dtype (``services.weights.delta_chain``): only the
    elements that changed, a full version every ``full_every`` versions or when a delta is larger
    than ``delta_max_fraction`` of it; replicas apply it in place (``services.weights.delta_sync``).
    A LoRA policy's chain holds its merged weights; refused with trainer.lora.sync adapter
    (Settings) and under torchrun."""

    mode: Literal["delta"] = "delta"
    full_every: Int = Field(20, gt=0)
    delta_max_fraction: Float = Field(0.25, gt=0, le=1)
    # services.weights.delta: index+value, XOR of the bits, either in byte planes, or per tensor the
    # smaller of the two byte-plane frames, or grouped (the changed elements in the old tensor's
    # exponent order, which replicas' workers resolve against their shadow before the pause; all
    # zstd); grouped is the smallest measured (docs/performance/training.md)
    encoding: Literal["set", "xor", "set-planes", "xor-planes", "grouped", "smallest"] = "grouped"
    # Replicas pack the next version's changed linear layers before the pause and only swap them in
    # while paused (services.inference.packed_swap): the pause does not grow with the model. The cost
    # is memory: until the swap each vLLM worker holds a second packed copy of the changed layers
    # (+1.5 GB at Qwen2.5-0.5B in bf16, docs/performance/training.md). false: the delta is applied
    # in place while paused and loaded through vLLM's in-memory reload, which repacks every layer.
    prebuild: bool = True
    # Where the trainer compares each version with the one before: host (copies every tensor to
    # the host, encodes there) or device (the model's device: for grouped frames on a GPU the
    # comparison and order run there and only the changed set is copied; the writer keeps the last
    # version on that device: 2 bytes per parameter more of its memory in bf16).
    encode_on: Literal["host", "device"] = "host"


# the mode names the variant: a field of the other mode is an error naming it
# (inference.weight_sync.s3.checkpoint_every: Extra inputs are not permitted)
WeightSync = Annotated[Union[S3WeightSync, NcclWeightSync, DeltaWeightSync], Field(discriminator="mode"),
                       read_mode("mode", "s3")]


class InferenceSettings(Section):
    base_url: str = "http://127.0.0.1:8000"
    replica_urls: list[str] = Field(default_factory=list)  # every replica to keep in sync; [] = [base_url]
    weights_dir: Path = Path(".conveyor/weights")  # where the weight follower puts downloaded checkpoints
    model: str = "tiny"  # served model name
    # The run has an inference server of its own at base_url (serving model, model_path): intake
    # names it in every rollout request (shared.schemas.InferenceTarget), so the shared rollout
    # workers call it for this run instead of their own inference settings. `conveyor run submit
    # --inference own` (or auto, when the shared server is held) launches the server and sets
    # this; off, the workers' settings decide
    own_server: bool = False
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
    # How new weights reach the replicas: {mode: s3}, {mode: nccl, backend, host, port, checkpoint_every}
    # or {mode: delta, full_every, delta_max_fraction, encoding, prebuild} (S3WeightSync, NcclWeightSync,
    # DeltaWeightSync). The mode alone may be written as a string (weight_sync: nccl),
    # and the nccl fields by their older flat names (weight_sync_host, weight_sync_port,
    # weight_sync_checkpoint_every: FOLDED_NAMES). nccl with trainer.lora is refused (Settings):
    # the broadcast carries full weights only.
    weight_sync: WeightSync = S3WeightSync()

    FOLDED_NAMES: ClassVar[dict[str, tuple[str, str]]] = {
        "weight_sync_host": ("weight_sync", "host"),
        "weight_sync_port": ("weight_sync", "port"),
        "weight_sync_checkpoint_every": ("weight_sync", "checkpoint_every"),
    }

    @model_validator(mode="before")
    @classmethod
    def _fold_flat_names(cls, data: Any) -> Any:
        return fold_names(cls, data)
