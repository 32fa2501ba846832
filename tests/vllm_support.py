"""A real vLLM server for a test module: started on a free port, and stopped with nothing of its
process group surviving (asserted). Eager unless a test says otherwise: the tests decode little,
and eager vLLM serves in about a third of the start-up time (bench/vllm_startup.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from services.cli.local_stack import free_port
from services.inference.server import VllmServer


@contextmanager
def running_vllm(model_dir: Path, served_name: str, log_path: Path, max_model_len: int,
                 extra_args: tuple[str, ...] = (), **options: Any) -> Iterator[VllmServer]:
    """``options``: more of ``VllmServer``'s keyword arguments (``lora_rank``, ...)."""
    srv = VllmServer(model_dir, served_name, port=free_port(), log_path=log_path, max_model_len=max_model_len,
                     extra_args=extra_args, **{"eager": True, **options})
    srv.start()
    pgid = srv.process.pid
    try:
        srv.wait_ready(timeout=600)
        yield srv
    finally:
        srv.stop()
        with pytest.raises(ProcessLookupError):  # nothing of the server's group survives
            os.killpg(pgid, 0)
