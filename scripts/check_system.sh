#!/usr/bin/env bash
# Checks the system programs Conveyor's local mode needs and says how to get the missing ones.
set -u
missing=0
for need in "$@"; do
  case "$need" in
    redis)  command -v redis-server >/dev/null || { echo "missing: redis-server (Debian/Ubuntu: apt-get install -y redis-server)"; missing=1; } ;;
    docker) docker info >/dev/null 2>&1 || { echo "missing: a running Docker daemon (apt-get install -y docker.io; dockerd &)"; missing=1; }
            { docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null; } || { echo "missing: docker compose v2 or docker-compose (apt-get install -y docker-compose)"; missing=1; }
            command -v debootstrap >/dev/null || { echo "missing: debootstrap, to build the local base image (apt-get install -y debootstrap; run as root)"; missing=1; } ;;
  esac
done
exit $missing
