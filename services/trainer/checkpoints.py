"""Policy checkpoints in object storage, and trainer resume.

Layout, one checkpoint per policy version:
``checkpoints/{run}/{version:06d}/`` holds what ``save_pretrained`` writes for the model
(``*.safetensors`` in shards of at most ``CHECKPOINT_SHARD_SIZE`` with their index,
``config.json``, ``generation_config.json``) and the tokenizer, the
logprob probe (``logprob_probe.json``: what a replica serving these weights must answer,
``services.policy.probe``), then ``trainer_state.pt`` (optimizer state dict, step, version), then ``COMMITTED``: a JSON
manifest naming every file with its size and sha256. A sharded trainer (torchrun,
``services.trainer.distributed``) keeps its optimizer state (and its model's shards) in
``trainer_state_sharded/`` instead, each rank's files written by that rank; ``trainer_state.pt``
then holds only step and version.

Invariants:
- ``COMMITTED`` is written last. A checkpoint without it does not exist for any reader:
  ``latest_checkpoint`` skips it and ``download_checkpoint`` refuses it. So a trainer dying
  mid-upload leaves nothing a reader could half-load.
- A committed version is never overwritten (``save_checkpoint`` raises): what inference may
  already serve under a version number stays that version.
- ``download_checkpoint`` writes exactly the manifest's files (each checked against its sha256,
  each renamed into place whole) into a directory that ``from_pretrained`` and vLLM's
  ``reload_weights(weights_path=...)`` load. The optimizer state is left out unless asked for.
- ``resume`` restores weights, optimizer state and step of the highest committed version; with
  no checkpoint it changes nothing and returns ``(0, 0)``: version 0 is the initial policy. It
  reads a sharded trainer's checkpoint too (its optimizer state from the shards), so a run
  started under torchrun can go on in one process.
- A LoRA policy (a ``PeftModel``, ``services.trainer.lora``) is checkpointed as what vLLM
  serves (``lora_sync``: the merged full weights, or the adapter alone in peft's layout) plus
  the adapter's own weights in the trainer state; its resume loads the adapter and the
  optimizer state, never the merged weights (the base stays the served base checkpoint). A
  LoRA checkpoint resumed without LoRA, or the reverse, is a ``CheckpointError`` naming the
  setting, before anything is loaded. A LoRA policy has no ``Snapshot`` (``take_snapshot``
  and ``save_checkpoint(snapshot=...)`` refuse one): snapshots serve only the nccl weight
  sync, which settings refuse with ``trainer.lora``.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from torch.utils._pytree import tree_map
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from services.weights.checkpoint_files import CheckpointError
from services.weights.checkpoint_files import download_checkpoint as fetch_checkpoint
from services.trainer.lora import adapter_state, check_adapter_shape, load_adapter_state, lora_shape, save_served
from services.policy.model import logprob_probe
from services.trainer.sharding import load_sharded
from shared.names import (
    CHECKPOINT_COMMITTED,
    CHECKPOINT_PROBE,
    CHECKPOINT_SHARDED_STATE,
    CHECKPOINT_TRAINER_STATE,
    checkpoint_prefix,
    checkpoints_of_run,
)
from services.policy.probe import LogprobProbe
from shared.storage import ObjectStore, StorageError
from shared.storage_faults import wait_out_disk_faults

COMMITTED = CHECKPOINT_COMMITTED
TRAINER_STATE = CHECKPOINT_TRAINER_STATE
SHARDED_STATE = CHECKPOINT_SHARDED_STATE
# Weight shards of at most this size (transformers' default is 50GB, one file for a 7B model):
# each file is read whole for its upload and download, so this bounds that memory.
CHECKPOINT_SHARD_SIZE = "1GB"



def _upload_order(name: str) -> tuple[int, str]:
    """Weights first, then the rest of the model dir, then the trainer state."""
    if name.endswith(".safetensors") or name.endswith(".safetensors.index.json"):
        return 0, name
    return (2 if name == TRAINER_STATE else 1), name


def is_committed(store: ObjectStore, prefix: str) -> bool:
    return prefix + COMMITTED in store.list_keys(prefix)


_NO_LORA_SNAPSHOT = ("a snapshot of a LoRA policy is not supported (it is taken only for inference.weight_sync: "
                     "nccl, which trainer.lora does not support); save its checkpoint without one")


@dataclass(frozen=True)
class Snapshot:
    """A CPU copy of what a checkpoint holds, so it can be written while training goes on."""

    version: int
    weights: dict[str, torch.Tensor]
    optimizer: dict
    probe: LogprobProbe


def _cpu_copy(value):
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def take_snapshot(model: PreTrainedModel, optimizer: torch.optim.Optimizer, version: int,
                  probe: LogprobProbe | None = None) -> Snapshot:
    """Copy the weights and optimizer state to CPU (host memory: once more the model and its
    optimizer state) and compute the logprob probe unless given. A LoRA policy (``PeftModel``)
    is refused: its checkpoint is the merged weights or the adapter, not its own state dict."""
    if isinstance(model, PeftModel):
        raise ValueError(_NO_LORA_SNAPSHOT)
    weights = {k: _cpu_copy(v) for k, v in model.state_dict().items()}
    state = tree_map(_cpu_copy, optimizer.state_dict())
    return Snapshot(version, weights, state, probe if probe is not None else logprob_probe(model, version))


def save_checkpoint(
    store: ObjectStore,
    run_id: str,
    version: int,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    optimizer: torch.optim.Optimizer,
    step: int,
    dataset_versions: list[str] | None = None,
    lora_sync: str = "merged",
    snapshot: Snapshot | None = None,
    sharded_files: dict[str, dict] | None = None,
    probe: LogprobProbe | None = None,
    step_metrics: dict[str, Any] | None = None,
) -> str:
    """Upload the checkpoint of ``version`` and commit it; returns its key prefix. The manifest
    records the dataset versions the run's intake published from (``dataset_versions``), and a
    LoRA policy's adapter shape and ``lora_sync`` (what the checkpoint serves).
    With ``snapshot`` (of ``version``), the weights, optimizer state and probe come from it and
    ``model`` only gives the config: the model may be training meanwhile. A snapshot of a LoRA
    policy is not supported (``take_snapshot`` refuses one, and so does this).
    ``sharded_files``: the manifest entries of the ``trainer_state_sharded/`` files every rank of
    a sharded trainer has already uploaded under the prefix (``services.trainer.distributed``);
    the optimizer state is in them, so ``trainer_state.pt`` holds step and version only.
    ``probe``: the logprob probe of ``model`` at ``version`` when the caller already has it.
    ``step_metrics``: the step's metrics line (JSON values), kept in the manifest for a trainer
    that dies after the commit and before it logs the line."""
    prefix = checkpoint_prefix(run_id, version)
    if is_committed(store, prefix):
        raise CheckpointError(f"checkpoint {prefix} is already committed; versions are never overwritten")
    lora = isinstance(model, PeftModel)
    if snapshot is not None and lora:
        raise ValueError(_NO_LORA_SNAPSHOT)
    if snapshot is not None and snapshot.version != version:
        raise ValueError(f"snapshot of version {snapshot.version} saved as version {version}")

    def stage_and_upload() -> dict[str, dict]:  # run again whole after a fault of the scratch disk
        with tempfile.TemporaryDirectory(prefix="conveyor-ckpt-") as tmp:
            local = Path(tmp)
            if lora:
                save_served(model, local, lora_sync, max_shard_size=CHECKPOINT_SHARD_SIZE)
            else:
                model.save_pretrained(local, safe_serialization=True, max_shard_size=CHECKPOINT_SHARD_SIZE,
                                      **({"state_dict": snapshot.weights} if snapshot is not None else {}))
            if not (lora and lora_sync == "adapter"):  # vLLM takes an adapter's tokenizer from the base
                tokenizer.save_pretrained(local)
            served_probe = snapshot.probe if snapshot is not None else probe or logprob_probe(model, version)
            (local / CHECKPOINT_PROBE).write_bytes(served_probe.to_json())
            state: dict[str, Any] = {"step": step, "version": version}
            if not sharded_files:  # else the optimizer state is in the shards
                state["optimizer"] = snapshot.optimizer if snapshot is not None else optimizer.state_dict()
            if lora:
                state["adapter"] = adapter_state(model)
            torch.save(state, local / TRAINER_STATE)
            names = sorted((p.name for p in local.iterdir() if p.is_file()), key=_upload_order)
            return {name: upload_file(store, prefix, local / name) for name in names} | (sharded_files or {})

    files = wait_out_disk_faults("checkpoint scratch folder", stage_and_upload)
    fields = {"run_id": run_id, "version": version, "step": step, "dataset_versions": list(dataset_versions or [])}
    if lora:
        fields["lora"] = {**lora_shape(model), "sync": lora_sync}
    if step_metrics is not None:
        fields["step_metrics"] = step_metrics
    commit_checkpoint(store, prefix, fields, files)
    return prefix


def upload_file(store: ObjectStore, prefix: str, path: Path) -> dict[str, int | str]:
    """Upload one checkpoint file as ``prefix + path.name``; its manifest entry (size, sha256).

    The file is read whole: ``CHECKPOINT_SHARD_SIZE`` bounds what that costs in memory."""
    data = path.read_bytes()
    store.put_bytes(prefix + path.name, data)
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def commit_checkpoint(store: ObjectStore, prefix: str, fields: dict, files: dict[str, dict]) -> None:
    """Write the ``COMMITTED`` manifest (``fields`` plus ``saved_at`` and ``files``): last, always."""
    manifest = {**fields, "saved_at": time.time(), "files": files}
    store.put_bytes(prefix + COMMITTED, json.dumps(manifest, indent=1).encode())


def read_manifest(store: ObjectStore, prefix: str) -> dict:
    try:
        return json.loads(store.get_bytes(prefix + COMMITTED))
    except StorageError as exc:
        raise CheckpointError(f"checkpoint {prefix} is not committed (no {COMMITTED} marker)") from exc


def latest_checkpoint(store: ObjectStore, run_id: str) -> tuple[int, str] | None:
    """(version, prefix) of the highest committed checkpoint of the run, or None."""
    base = checkpoints_of_run(run_id)
    versions = []
    for key in store.list_keys(base):
        parts = key[len(base):].split("/")
        if len(parts) == 2 and parts[1] == COMMITTED and parts[0].isdigit():
            versions.append(int(parts[0]))
    if not versions:
        return None
    version = max(versions)
    return version, checkpoint_prefix(run_id, version)


def download_checkpoint(store: ObjectStore, prefix: str, local_dir: str | Path, with_trainer_state: bool = False,
                        only: frozenset[str] | None = None) -> Path:
    """Fetch the committed checkpoint (``only`` those files, if given) into ``local_dir`` (which
    must not exist yet) and return it; the one reader in ``services.weights.checkpoint_files`` checks
    every file against the manifest."""
    return fetch_checkpoint(store, prefix, Path(local_dir), with_trainer_state=with_trainer_state, only=only).local_dir


def sharded_state_files(store: ObjectStore, prefix: str) -> frozenset[str]:
    """The ``trainer_state_sharded/`` files of a committed checkpoint (none if one process wrote it)."""
    return frozenset(name for name in read_manifest(store, prefix)["files"] if name.startswith(SHARDED_STATE + "/"))


def check_lora_kind(prefix: str, state: dict, model: torch.nn.Module) -> None:
    """A LoRA checkpoint (its trainer state holds the adapter) resumes only into a LoRA policy of
    the same shape, and a full one only into a full policy."""
    if isinstance(model, PeftModel) != ("adapter" in state):
        raise CheckpointError(f"{prefix} is a checkpoint of a run {'with' if 'adapter' in state else 'without'} "
                              f"LoRA; set trainer.lora.enabled: {str('adapter' in state).lower()} to resume it")
    if "adapter" in state:
        check_adapter_shape(state["adapter"]["shape"], model)


def resume(store: ObjectStore, run_id: str, model: PreTrainedModel, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Load the latest committed checkpoint into ``model`` and ``optimizer``; (version, step).
    A LoRA policy gets its adapter back, and its base is left as it is."""
    latest = latest_checkpoint(store, run_id)
    if latest is None:
        return 0, 0
    version, prefix = latest
    lora = isinstance(model, PeftModel)
    with tempfile.TemporaryDirectory(prefix="conveyor-resume-") as tmp:
        # a LoRA policy needs only the trainer state (the adapter is in it) and any sharded state
        only = frozenset({TRAINER_STATE}) | sharded_state_files(store, prefix) if lora else None
        local = download_checkpoint(store, prefix, Path(tmp) / "checkpoint", with_trainer_state=True, only=only)
        state = torch.load(local / TRAINER_STATE, map_location="cpu", weights_only=True)
        if state.get("version") != version:
            raise CheckpointError(f"{prefix}{TRAINER_STATE} is for version {state.get('version')}, not {version}")
        check_lora_kind(prefix, state, model)
        if lora:
            load_adapter_state(model, state["adapter"])
        else:
            saved = AutoModelForCausalLM.from_pretrained(str(local), dtype=next(model.parameters()).dtype)
            model.load_state_dict(saved.state_dict(), strict=True)
        if "optimizer" in state:
            optimizer.load_state_dict(state["optimizer"])
        else:  # written by a sharded trainer: its optimizer state is in the shards
            load_sharded(model, optimizer, local / SHARDED_STATE)
    return version, int(state["step"])
