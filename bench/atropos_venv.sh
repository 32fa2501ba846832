#!/usr/bin/env bash
# A venv with atroposlib 0.4.0 for bench/atropos_side_by_side.py only; never Conveyor's venv.
# Usage: bench/atropos_venv.sh [venv dir, default .bench/atropos-venv]
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.bench/atropos-venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3.11 -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet 'atroposlib==0.4.0'
"$venv/bin/python" -c "import atroposlib.api.server; print('atroposlib', __import__('importlib.metadata').metadata.version('atroposlib'))"
