"""Fixtures of the unit tests: the ledger on the session's real Redis (flushed per test) and a
local object store per test."""

from __future__ import annotations

import json

import pytest

from services.intake.datasets import Row, BadRow, read_rows

from shared.state.ledger import Ledger
from shared.storage import LocalStore


@pytest.fixture
def ledger(redis_client) -> Ledger:
    return Ledger(redis_client)


@pytest.fixture
def store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "objects")


@pytest.fixture
def two_env_rows(tmp_path) -> list[Row | BadRow]:
    """30 guess_number rows and 10 qa rows, read as intake reads a JSONL dataset."""
    path = tmp_path / "rows.jsonl"
    rows = [{"id": f"g{i}", "low": 1, "high": 9, "target": 1 + i % 9} for i in range(30)]
    rows += [{"id": f"q{i}", "env_key": "qa", "question": f"{i}+{i}?", "answer": str(2 * i)} for i in range(10)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return read_rows(path)
