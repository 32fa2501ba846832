"""Policy checkpoints in object storage, and trainer resume.

Layout, one checkpoint per policy version:
``checkpoints/{run}/{version:06d}/`` holds what ``save_pretrained`` writes for the model
(``*.safetensors``, ``config.json``, ``generation_config.json``) and the tokenizer, the
logprob probe (``logprob_probe.json``: what a replica serving these weights must answer,
``shared.logprob_probe``), then ``trainer_state.pt`` (optimizer state dict, step, version), then ``COMMITTED``: a JSON
manifest naming every file with its size and sha256.

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
  no checkpoint it changes nothing and returns ``(0, 0)``: version 0 is the initial policy.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._pytree import tree_map
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from shared.checkpoint_files import CheckpointError
from shared.checkpoint_files import download_checkpoint as fetch_checkpoint
from services.trainer.policy import logprob_probe
from shared.names import (
    CHECKPOINT_COMMITTED,
    CHECKPOINT_PROBE,
    CHECKPOINT_TRAINER_STATE,
    checkpoint_prefix,
    checkpoints_of_run,
)
from shared.logprob_probe import LogprobProbe
from shared.storage import ObjectStore, StorageError

COMMITTED = CHECKPOINT_COMMITTED
TRAINER_STATE = CHECKPOINT_TRAINER_STATE
# Weight shards of at most this size (transformers' default is 50GB, one file for a 7B model):
# each file is read whole for its upload and download, so this bounds that memory.
CHECKPOINT_SHARD_SIZE = "1GB"



def _upload_order(name: str) -> tuple[int, str]:
    """Weights first, then the rest of the model dir, then the trainer state."""
    if name.endswith(".safetensors") or name.endswith(".safetensors.index.json"):
        return 0, name
    return (2 if name == TRAINER_STATE else 1), name


def _is_committed(store: ObjectStore, prefix: str) -> bool:
    return prefix + COMMITTED in store.list_keys(prefix)


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
    optimizer state) and compute the logprob probe unless given."""
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
    snapshot: Snapshot | None = None,
) -> str:
    """Upload the checkpoint of ``version`` and commit it; returns its key prefix. The manifest
    records the dataset versions the run's intake published from (``dataset_versions``).
    With ``snapshot`` (of ``version``), the weights, optimizer state and probe come from it and
    ``model`` only gives the config: the model may be training meanwhile."""
    prefix = checkpoint_prefix(run_id, version)
    if _is_committed(store, prefix):
        raise CheckpointError(f"checkpoint {prefix} is already committed; versions are never overwritten")
    if snapshot is not None and snapshot.version != version:
        raise ValueError(f"snapshot of version {snapshot.version} saved as version {version}")
    with tempfile.TemporaryDirectory(prefix="conveyor-ckpt-") as tmp:
        local = Path(tmp)
        model.save_pretrained(local, safe_serialization=True, max_shard_size=CHECKPOINT_SHARD_SIZE,
                              **({"state_dict": snapshot.weights} if snapshot is not None else {}))
        tokenizer.save_pretrained(local)
        probe = snapshot.probe if snapshot is not None else logprob_probe(model, version)
        (local / CHECKPOINT_PROBE).write_bytes(probe.to_json())
        optimizer_state = snapshot.optimizer if snapshot is not None else optimizer.state_dict()
        torch.save({"optimizer": optimizer_state, "step": step, "version": version}, local / TRAINER_STATE)
        names = sorted((p.name for p in local.iterdir() if p.is_file()), key=_upload_order)
        files = {name: upload_file(store, prefix, local / name) for name in names}
    commit_checkpoint(store, prefix, {"run_id": run_id, "version": version, "step": step,
                                      "dataset_versions": list(dataset_versions or [])}, files)
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


def download_checkpoint(store: ObjectStore, prefix: str, local_dir: str | Path, with_trainer_state: bool = False) -> Path:
    """Fetch the committed checkpoint into ``local_dir`` (which must not exist yet) and return
    it; the one reader in ``shared.checkpoint_files`` checks every file against the manifest."""
    return fetch_checkpoint(store, prefix, Path(local_dir), with_trainer_state=with_trainer_state).local_dir


def resume(store: ObjectStore, run_id: str, model: PreTrainedModel, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Load the latest committed checkpoint into ``model`` and ``optimizer``; (version, step)."""
    latest = latest_checkpoint(store, run_id)
    if latest is None:
        return 0, 0
    version, prefix = latest
    with tempfile.TemporaryDirectory(prefix="conveyor-resume-") as tmp:
        local = download_checkpoint(store, prefix, Path(tmp) / "checkpoint", with_trainer_state=True)
        dtype = next(model.parameters()).dtype
        saved = AutoModelForCausalLM.from_pretrained(str(local), dtype=dtype)
        model.load_state_dict(saved.state_dict(), strict=True)
        state = torch.load(local / TRAINER_STATE, map_location="cpu", weights_only=True)
    if state.get("version") != version:
        raise CheckpointError(f"{prefix}{TRAINER_STATE} is for version {state.get('version')}, not {version}")
    optimizer.load_state_dict(state["optimizer"])
    return version, int(state["step"])
