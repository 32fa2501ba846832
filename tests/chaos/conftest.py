"""Fixtures of the chaos suite: the session's vLLM server (the tiny model, ``served_model`` in
tests/conftest.py), so the cases do not pay its start; each case breaks only what it owns (its
Redis, its object store, its workers)."""

from __future__ import annotations

import pytest
from pipeline_support import base_stack


@pytest.fixture(scope="module")
def base(tmp_path_factory, served_model):
    """Redis and S3 shared by one module's tests, on the session's vLLM."""
    with base_stack(tmp_path_factory.mktemp("chaos"), served_model) as stack:
        yield stack
