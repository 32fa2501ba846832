"""The process's docker client: the local daemon or ``DOCKER_HOST``, with a connection pool sized
for concurrent provisioning (the SDK's default of 10 connections drops connections under load)."""

from __future__ import annotations

import functools

import docker

POOL_SIZE = 64
TIMEOUT_S = 120


@functools.lru_cache(maxsize=1)
def default_client() -> docker.DockerClient:
    return docker.from_env(max_pool_size=POOL_SIZE, timeout=TIMEOUT_S)
