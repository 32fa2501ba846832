"""Reading a committed checkpoint out of object storage: one reader for the trainer's resume and
the inference control plane's weight sync.

Invariants:
- A checkpoint exists only once its ``COMMITTED`` marker is listed; before that,
  ``CheckpointNotCommitted``. When the marker is a manifest (``{"files": {name: {"size",
  "sha256"}}}``, as the trainer writes it), exactly its files are fetched and each is checked
  against it (``CheckpointCorrupt``).
- ``trainer_state.pt`` (optimizer state) and a sharded trainer's ``trainer_state_sharded/``
  are fetched only when asked for: replicas never get them.
  ``only`` narrows a download to the named files (a LoRA trainer's resume needs nothing else).
- The destination directory appears only complete (download to a temporary name, then
  rename), so an existing destination is reused as it is.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.names import CHECKPOINT_COMMITTED, CHECKPOINT_SHARDED_STATE, CHECKPOINT_TRAINER_STATE
from shared.storage import ObjectStore

COMMITTED_MARKER = CHECKPOINT_COMMITTED
DOWNLOAD_THREADS = 4


class CheckpointError(RuntimeError):
    pass


class CheckpointNotCommitted(CheckpointError):
    """The announced prefix has no COMMITTED marker (yet)."""


class CheckpointCorrupt(CheckpointError):
    """A downloaded file does not match the checkpoint's manifest."""


@dataclass(frozen=True)
class Download:
    local_dir: Path
    files: int
    bytes: int
    seconds: float
    reused: bool


def _manifest_files(store: ObjectStore, prefix: str) -> dict[str, dict[str, Any]] | None:
    """The marker's ``{"files": {name: {"size", "sha256"}}}`` manifest, if it holds one."""
    try:
        manifest = json.loads(store.get_bytes(prefix + COMMITTED_MARKER) or b"null")
    except (ValueError, UnicodeDecodeError):
        return None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    return files if isinstance(files, dict) else None


def download_checkpoint(store: ObjectStore, prefix: str, dest: Path, *, with_trainer_state: bool = False,
                        only: frozenset[str] | None = None) -> Download:
    """Copy the checkpoint under ``prefix`` into ``dest`` (weights, config, tokenizer files).

    Reuses ``dest`` if it exists (it only ever exists complete). Raises
    ``CheckpointNotCommitted`` if the marker is not listed. If the marker is a manifest
    (``{"files": {name: {"size", "sha256"}}}``, as ``services.trainer.checkpoints`` writes),
    exactly its files are fetched and each is checked against it (``CheckpointCorrupt``);
    otherwise every listed object but the skipped ones is fetched.
    """
    t0 = time.perf_counter()
    dest = Path(dest)
    if dest.is_dir():
        files = [p for p in dest.rglob("*") if p.is_file()]
        return Download(dest, len(files), sum(p.stat().st_size for p in files), time.perf_counter() - t0, True)
    keys = store.list_keys(prefix)
    names = {k[len(prefix):]: k for k in keys if k.startswith(prefix)}
    if COMMITTED_MARKER not in names:
        raise CheckpointNotCommitted(f"checkpoint {prefix} is not committed: no {COMMITTED_MARKER} marker (yet)")
    manifest = _manifest_files(store, prefix)
    listed = manifest if manifest is not None else names
    trainer_only = {CHECKPOINT_TRAINER_STATE, CHECKPOINT_SHARDED_STATE}
    skipped = {COMMITTED_MARKER} | (set() if with_trainer_state else trainer_only)
    wanted = {name: prefix + name for name in listed
              if Path(name).name not in skipped and Path(name).parts[0] not in skipped and (only is None or name in only)}
    for name in wanted:
        if name.startswith("/") or ".." in Path(name).parts:
            raise ValueError(f"checkpoint object {prefix}{name} escapes its directory")
    partial = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
    partial.mkdir(parents=True)

    def fetch(item: tuple[str, str]) -> int:
        name, key = item
        data = store.get_bytes(key)
        if manifest is not None:
            meta = manifest[name]
            if len(data) != meta.get("size") or hashlib.sha256(data).hexdigest() != meta.get("sha256"):
                raise CheckpointCorrupt(f"{key} does not match the checkpoint manifest (size or sha256)")
        path = partial / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return len(data)

    try:
        with ThreadPoolExecutor(max_workers=DOWNLOAD_THREADS, thread_name_prefix="ckpt-download") as pool:
            sizes = list(pool.map(fetch, wanted.items()))
        partial.rename(dest)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return Download(dest, len(sizes), sum(sizes), time.perf_counter() - t0, False)
