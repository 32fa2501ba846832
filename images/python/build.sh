#!/bin/sh
# Build the coding environment's Python sandbox image offline (debootstrap + docker import) and
# print its tag. The recipe is packages.txt beside this file; the tag is its content hash, so an
# existing image is reused. Needs root, debootstrap and a reachable Debian mirror (~1 min).
# Usage: images/python/build.sh [--ca-bundle FILE]
set -eu
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-.venv/bin/python}"
exec "$PYTHON" -m services.rollout_worker.environments.coding.images "$@"
