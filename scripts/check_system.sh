#!/usr/bin/env bash
# Checks the system programs Conveyor's local mode needs and says how to get the missing ones.
set -u
missing=0
for need in "$@"; do
  case "$need" in
    redis)  command -v redis-server >/dev/null || { echo "missing: redis-server (Debian/Ubuntu: apt-get install -y redis-server)"; missing=1; } ;;
    docker) docker info >/dev/null 2>&1 || { echo "missing: a running Docker daemon (apt-get install -y docker.io; dockerd &)"; missing=1; } ;;
  esac
done
exit $missing
