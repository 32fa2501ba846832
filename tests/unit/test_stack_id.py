"""Where a stack id comes from: CONVEYOR_STACK_ID, else a hash of the checkout path, so that two
checkouts on one daemon differ with nothing set."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.rollout_worker.sandbox import SandboxLabels
from shared.settings import load_settings
from shared.stack_id import STACK_ID_ENV, checkout_stack_id, current_stack_id


def test_two_checkouts_get_two_stack_ids_and_one_checkout_always_the_same(tmp_path: Path) -> None:
    first, second = tmp_path / "one", tmp_path / "two"
    assert checkout_stack_id(first) != checkout_stack_id(second)
    assert checkout_stack_id(first) == checkout_stack_id(tmp_path / "one" / ".." / "one")


def test_the_environment_names_the_stack_and_sandbox_labels_follow_it(monkeypatch) -> None:
    monkeypatch.delenv(STACK_ID_ENV, raising=False)
    assert current_stack_id() == checkout_stack_id()
    monkeypatch.setenv(STACK_ID_ENV, "conveyor-1a2b3c4d")
    assert current_stack_id() == "conveyor-1a2b3c4d"
    assert SandboxLabels(run_id="r", group_id="g", trajectory_id="t").stack_id == "conveyor-1a2b3c4d"
    load_settings()  # a runtime variable, not an unknown setting


def test_a_stack_id_that_cannot_be_a_label_is_refused(monkeypatch) -> None:
    monkeypatch.setenv(STACK_ID_ENV, "two words")
    with pytest.raises(ValueError, match="CONVEYOR_STACK_ID"):
        current_stack_id()
