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
- A LoRA policy (a ``PeftModel``, ``services.trainer.lora``) is checkpointed as what vLLM
  serves (``lora_sync``: the merged full weights, or the adapter alone in peft's layout) plus
  the adapter's own weights in the trainer state; its resume loads the adapter and the
  optimizer state, never the merged weights (the base stays the served base checkpoint). A
  LoRA checkpoint resumed without LoRA, or the reverse, is a ``CheckpointError`` naming the
  setting, before anything is loaded.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from shared.checkpoint_files import CheckpointError
from shared.checkpoint_files import download_checkpoint as fetch_checkpoint
from services.trainer.lora import adapter_state, load_adapter_state, lora_shape, save_served
from services.trainer.policy import logprob_probe
from shared.names import (
    CHECKPOINT_COMMITTED,
    CHECKPOINT_PROBE,
    CHECKPOINT_TRAINER_STATE,
    checkpoint_prefix,
    checkpoints_of_run,
)
from shared.storage import ObjectStore, StorageError

COMMITTED = CHECKPOINT_COMMITTED
TRAINER_STATE = CHECKPOINT_TRAINER_STATE



def _upload_order(name: str) -> tuple[int, str]:
    """Weights first, then the rest of the model dir, then the trainer state."""
    if name.endswith(".safetensors") or name.endswith(".safetensors.index.json"):
        return 0, name
    return (2 if name == TRAINER_STATE else 1), name


def _is_committed(store: ObjectStore, prefix: str) -> bool:
    return prefix + COMMITTED in store.list_keys(prefix)


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
) -> str:
    """Upload the checkpoint of ``version`` and commit it; returns its key prefix. The manifest
    records the dataset versions the run's intake published from (``dataset_versions``), and a
    LoRA policy's adapter shape and ``lora_sync`` (what the checkpoint serves)."""
    prefix = checkpoint_prefix(run_id, version)
    if _is_committed(store, prefix):
        raise CheckpointError(f"checkpoint {prefix} is already committed; versions are never overwritten")
    with tempfile.TemporaryDirectory(prefix="conveyor-ckpt-") as tmp:
        local = Path(tmp)
        state = {"optimizer": optimizer.state_dict(), "step": step, "version": version}
        if isinstance(model, PeftModel):
            save_served(model, local, lora_sync)
            state["adapter"] = adapter_state(model)
        else:
            model.save_pretrained(local, safe_serialization=True)
        if not (isinstance(model, PeftModel) and lora_sync == "adapter"):  # vLLM takes an adapter's from the base
            tokenizer.save_pretrained(local)
        (local / CHECKPOINT_PROBE).write_bytes(logprob_probe(model, version).to_json())
        torch.save(state, local / TRAINER_STATE)
        names = sorted((p.name for p in local.iterdir() if p.is_file()), key=_upload_order)
        files = {}
        for name in names:
            data = (local / name).read_bytes()
            store.put_bytes(prefix + name, data)
            files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest = {"run_id": run_id, "version": version, "step": step, "saved_at": time.time(),
                "dataset_versions": list(dataset_versions or []), "files": files}
    if isinstance(model, PeftModel):
        manifest["lora"] = {**lora_shape(model), "sync": lora_sync}
    store.put_bytes(prefix + COMMITTED, json.dumps(manifest, indent=1).encode())
    return prefix


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
    must not exist yet) and return it; the one reader in ``shared.checkpoint_files`` checks
    every file against the manifest."""
    return fetch_checkpoint(store, prefix, Path(local_dir), with_trainer_state=with_trainer_state, only=only).local_dir


def resume(store: ObjectStore, run_id: str, model: PreTrainedModel, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Load the latest committed checkpoint into ``model`` and ``optimizer``; (version, step).
    A LoRA policy gets its adapter back, and its base is left as it is."""
    latest = latest_checkpoint(store, run_id)
    if latest is None:
        return 0, 0
    version, prefix = latest
    lora = isinstance(model, PeftModel)
    with tempfile.TemporaryDirectory(prefix="conveyor-resume-") as tmp:
        local = download_checkpoint(store, prefix, Path(tmp) / "checkpoint", with_trainer_state=True,
                                    only=frozenset({TRAINER_STATE}) if lora else None)  # the adapter is in it
        state = torch.load(local / TRAINER_STATE, map_location="cpu", weights_only=True)
        if state.get("version") != version:
            raise CheckpointError(f"{prefix}{TRAINER_STATE} is for version {state.get('version')}, not {version}")
        if lora != ("adapter" in state):
            raise CheckpointError(f"{prefix} is a checkpoint of a run {'with' if 'adapter' in state else 'without'} "
                                  f"LoRA; set trainer.lora.enabled: {str('adapter' in state).lower()} to resume it")
        if lora:
            load_adapter_state(model, state["adapter"])
        else:
            saved = AutoModelForCausalLM.from_pretrained(str(local), dtype=next(model.parameters()).dtype)
            model.load_state_dict(saved.state_dict(), strict=True)
    optimizer.load_state_dict(state["optimizer"])
    return version, int(state["step"])
