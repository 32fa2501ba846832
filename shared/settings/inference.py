"""Settings of the inference service: the model vLLM serves, how it is launched, and how weights
reach it.

Part of ``shared.settings`` (its docstring states the invariants every section keeps).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from shared.settings.base import Float, Int, PathOrName, Section


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
    # is refused here (Settings): the broadcast carries full weights only. delta: the trainer
    # writes its checkpoint as on s3 (the durable record) and publishes each version to the
    # run's delta chain in the served dtype (services.weights.delta_chain): only the elements
    # that changed, a full version every weight_sync_full_every versions or when a delta is
    # larger than weight_sync_delta_max_fraction of it; replicas apply it in place
    # (services.weights.delta_sync). delta with trainer.lora is refused (Settings).
    weight_sync: Literal["s3", "nccl", "delta"] = "s3"
    weight_sync_full_every: Int = Field(20, gt=0)
    weight_sync_delta_max_fraction: Float = Field(0.25, gt=0, le=1)
    weight_sync_delta_encoding: Literal["set", "xor"] = "set"  # index+value, or XOR of the bits (both zstd)
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
