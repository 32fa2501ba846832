"""docs/compose.md's line that makes a Hugging Face model already in this host's cache a plain
folder, ready to copy into the `models` volume (the copy itself is run by
``test_compose_stack.py::test_your_own_model_goes_into_the_models_volume_as_written_in_the_docs``).

The cache is built here as ``huggingface_hub`` lays it out (files in ``blobs/`` under their hash,
``snapshots/<commit>/`` holding links to them, ``refs/main`` naming the commit), with the tiny
model's files under the doc's model name: no hub is reachable, and the line must not need one.
The line runs by the shell as written, with this venv's ``python3`` first on ``PATH`` (the
user's Python with ``huggingface_hub``), offline."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from compose_support import doc_commands, run_as_written

from services.inference.tiny_model import generate_tiny_model

NAME = "Qwen/Qwen2.5-0.5B-Instruct"  # the doc's example
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache_holding(model: Path, hub: Path) -> Path:
    repo = hub / f"models--{NAME.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in model.iterdir():
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        (repo / "blobs" / digest).write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / digest)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def test_a_cached_hub_model_becomes_a_plain_folder_as_written_in_the_docs(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    model = generate_tiny_model(tmp_path / "tiny")
    snapshot = _cache_holding(model, tmp_path / "hub")
    assert all(f.is_symlink() for f in snapshot.iterdir())
    [line] = doc_commands("snapshot_download")
    assert NAME in line
    work = tmp_path / "work"
    work.mkdir()
    venv_bin = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{venv_bin}:{os.environ['PATH']}", "HF_HUB_CACHE": str(tmp_path / "hub"),
           "HF_HUB_OFFLINE": "1"}
    run_as_written(None, line, work, timeout=120, env=env)
    copied = work / "my-model"
    files = {f.name: f for f in copied.iterdir()}
    assert sorted(files) == sorted(f.name for f in model.iterdir())
    assert not any(f.is_symlink() for f in files.values())  # plain files: a mount of the folder works
    assert all(files[f.name].read_bytes() == f.read_bytes() for f in model.iterdir())
    AutoConfig.from_pretrained(copied)
    AutoTokenizer.from_pretrained(copied)
