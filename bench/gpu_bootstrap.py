"""Imports for the GPU host (issue 25): the packages Conveyor's trainer path needs beyond what
the host has (torch, transformers, peft, accelerate, safetensors, numpy and what they require),
from the host or from the wheels ``scripts/gpu_wheels.sh`` writes to ``wheels/gpu``.

Invariants:
- ``ensure_trainer_imports()`` returns ``"host"`` when every package in ``NEEDED_IMPORTS``
  imports as it is, and touches nothing.
- Otherwise it unpacks every wheel of ``wheels/gpu`` into a new temporary folder, puts that
  folder first on ``sys.path`` and imports them all; a wheel with a ``.data`` folder (one that
  only pip can install right) is refused, and so is an empty ``wheels/gpu``, naming the script.
  No pip and no network are needed.
- It imports nothing of torch, so it runs on any Python.
"""

from __future__ import annotations

import importlib
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "wheels" / "gpu"
# the import names of scripts/gpu_wheels.sh's requirements (tests/trainer/test_gpu_check.py checks both)
NEEDED_IMPORTS = ("pydantic", "pydantic_settings", "redis", "tenacity", "dotenv", "zstandard", "xxhash")


def ensure_trainer_imports(wheels: Path = WHEELS) -> str:
    """Where the trainer path's extra packages come from: ``host`` or ``wheels/gpu (N wheels)``."""
    try:
        for name in NEEDED_IMPORTS:
            importlib.import_module(name)
        return "host"
    except ImportError as missing:
        found = sorted(wheels.glob("*.whl"))
        if not found:
            raise SystemExit(f"{missing}; run scripts/gpu_wheels.sh where there is network, "
                             f"and carry {wheels} to this host") from None
    site = Path(tempfile.mkdtemp(prefix="conveyor-gpu-site-"))
    for wheel in found:
        with zipfile.ZipFile(wheel) as archive:
            if any(".data/" in name for name in archive.namelist()):
                raise SystemExit(f"{wheel.name} has a .data folder; install it with pip instead")
            archive.extractall(site)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    for name in NEEDED_IMPORTS:
        importlib.import_module(name)
    return f"wheels/gpu ({len(found)} wheels)"
