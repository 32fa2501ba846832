"""Rows that cannot grade are rejected at intake, against a real git repository (no Docker)."""

from __future__ import annotations

import pytest

from services.intake.adapters import RowRejected, adapt_row


@pytest.fixture
def env_config(tmp_path) -> dict:
    return {"workspace_cache_dir": str(tmp_path / "workspaces")}


def test_a_gradable_row_is_accepted_and_a_patch_missing_its_last_newline_is_normalised(swe_bench_row, env_config):
    task = adapt_row(swe_bench_row, "coding", "swe.jsonl:1", env_config)
    assert task.task_data["test_patch"] == swe_bench_row["test_patch"]
    clipped = {**swe_bench_row, "test_patch": swe_bench_row["test_patch"].rstrip("\n")}
    assert adapt_row(clipped, "coding", "swe.jsonl:2", env_config).task_data["test_patch"] == swe_bench_row["test_patch"]


def test_a_test_patch_that_does_not_apply_is_rejected_with_the_reason(swe_bench_row, env_config):
    # a new file where the base already has one, and a hunk whose context the base lacks
    broken = swe_bench_row["test_patch"].replace("tests/test_calc.py", "tests/test_existing.py")
    elsewhere = ("diff --git a/calc/__init__.py b/calc/__init__.py\n--- a/calc/__init__.py\n+++ b/calc/__init__.py\n"
                 "@@ -1,2 +1,2 @@\n-def nothing_like_this():\n+def add(a, b):\n     return a - b\n")
    for patch in (broken, elsewhere):
        with pytest.raises(RowRejected, match="test_patch does not apply to base_commit") as caught:
            adapt_row({**swe_bench_row, "test_patch": patch}, "coding", "swe.jsonl:3", env_config)
        assert swe_bench_row["base_commit"] in str(caught.value)


def test_a_commit_that_is_not_in_the_repository_is_rejected(swe_bench_row, env_config):
    with pytest.raises(RowRejected, match="cannot be checked out") as caught:
        adapt_row({**swe_bench_row, "base_commit": "0123456789abcdef0123456789abcdef01234567"}, "coding", "x", env_config)
    assert "0123456789abcdef" in str(caught.value)


def test_the_checks_can_be_turned_off_for_intake_without_repository_access(swe_bench_row, env_config):
    row = {**swe_bench_row, "base_commit": "0123456789abcdef0123456789abcdef01234567"}
    assert adapt_row(row, "coding", "x", {**env_config, "intake_checks": False}).task_data["base_commit"] == row["base_commit"]
