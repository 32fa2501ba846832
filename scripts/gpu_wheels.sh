#!/usr/bin/env bash
# The wheels bench/gpu_check.py needs on the GPU host (issue 25), into wheels/gpu/ (git-ignored).
#
# The GPU host has Python 3.12 with torch, transformers, peft, accelerate, safetensors and numpy
# (and what they require), and no network. Conveyor's trainer path (services/trainer/step.py,
# checkpoints.py, lora.py, sharding.py, the delta codec services/weights/delta*.py and the shared/
# modules they import) needs a few more
# packages at import time; they are listed below with pyproject.toml's version bounds, and pip
# resolves their own requirements. tests/trainer/test_gpu_check.py checks the list against the
# modules the trainer path imports and against pyproject.toml.
#
# Usage: scripts/gpu_wheels.sh [PYTHON]   (PYTHON: a Python with pip; default .venv/bin/python)
# Each requirement is pinned to the version installed in PYTHON (the one the tests ran with; it
# must lie within the bounds below), so a rerun fetches the same versions of them; pip picks
# their own requirements. The bundle must stay under 64 MiB (what the device machine carries),
# and the script fails if it does not.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${1:-.venv/bin/python}"
OUT=wheels/gpu
MAX_MIB=64

# --- trainer-path requirements (one per line; parsed by tests/trainer/test_gpu_check.py) ---
REQUIREMENTS=(
  "pydantic>=2.10,<3"
  "pydantic-settings>=2.6"
  "redis>=5"
  "tenacity>=9"
  "python-dotenv"
  "zstandard>=0.23"
  "xxhash>=3.4"
)
# --- end of requirements ---

# each requirement pinned to PYTHON's installed version, refused if outside its bounds
mapfile -t PINS < <("$PYTHON" - "${REQUIREMENTS[@]}" <<'PY'
import importlib.metadata as md
import sys

from packaging.requirements import Requirement

for spec in sys.argv[1:]:
    req = Requirement(spec)
    version = md.version(req.name)
    if version not in req.specifier:
        sys.exit(f"{req.name} {version} in {sys.executable} is outside {req.specifier}")
    print(f"{req.name}=={version}")
PY
)

rm -rf "$OUT"
mkdir -p "$OUT"
"$PYTHON" -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$OUT" "${PINS[@]}"
printf '%s\n' "${PINS[@]}" > "$OUT/requirements.txt"

size_mib=$(du -sm "$OUT" | cut -f1)
ls -1 "$OUT"
echo "wheels/gpu: ${size_mib} MiB"
if [ "$size_mib" -ge "$MAX_MIB" ]; then
  echo "wheels/gpu is ${size_mib} MiB, over the ${MAX_MIB} MiB the device machine carries" >&2
  exit 1
fi
