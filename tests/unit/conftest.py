"""Fixtures of the unit tests: the ledger on the session's real Redis (flushed per test) and a
local object store per test."""

from __future__ import annotations

import pytest

from shared.ledger import Ledger
from shared.storage import LocalStore


@pytest.fixture
def ledger(redis_client) -> Ledger:
    return Ledger(redis_client)


@pytest.fixture
def store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "objects")
