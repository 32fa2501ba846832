"""Fixtures of the chaos suite: one vLLM server (the tiny model) for the whole package, so the
cases pay its start once and it is gone before the next package starts its own; each case
breaks only what it owns (its Redis, its object store, its workers)."""

from __future__ import annotations

import pytest
from pipeline_support import ServedModel, base_stack, tiny_vllm


@pytest.fixture(scope="package")
def served_model(tmp_path_factory) -> ServedModel:
    with tiny_vllm(tmp_path_factory.mktemp("chaos-vllm")) as served:
        yield served


@pytest.fixture(scope="module")
def base(tmp_path_factory, served_model):
    """Redis and S3 shared by one module's tests, on the package's vLLM."""
    with base_stack(tmp_path_factory.mktemp("chaos"), served_model) as stack:
        yield stack
