"""Settings: sources and their priority, and SettingsError naming the bad field."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared.settings import Settings, SettingsError, load_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No CONVEYOR_* variables from the outside, and none left behind (load_settings sets CONVEYOR_CONFIG)."""
    monkeypatch.setenv("CONVEYOR_CONFIG", "placeholder")  # recorded, so it is removed again after the test
    for name in list(os.environ):
        if name.startswith("CONVEYOR_"):
            monkeypatch.delenv(name)


def write_yaml(tmp_path: Path, text: str, name: str = "conveyor.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults():
    settings = load_settings()
    assert settings.run_id == "run"
    assert settings.rollout.group_size == 4
    assert settings.storage.backend == "s3"
    assert settings.rewards.weights == {"verifier": 1.0, "format": 0.1}


def test_nested_env_var_override(monkeypatch):
    monkeypatch.setenv("CONVEYOR_ROLLOUT__GROUP_SIZE", "8")
    monkeypatch.setenv("CONVEYOR_ROLLOUT__SAMPLING__TEMPERATURE", "0.5")
    monkeypatch.setenv("CONVEYOR_RUN_ID", "exp-7")
    monkeypatch.setenv("CONVEYOR_STORAGE__BACKEND", "local")
    settings = load_settings()
    assert settings.rollout.group_size == 8
    assert settings.rollout.sampling.temperature == 0.5
    assert settings.rollout.max_turns == 4  # siblings keep their defaults
    assert settings.run_id == "exp-7"
    assert settings.storage.backend == "local"


def test_yaml_file(tmp_path):
    path = write_yaml(tmp_path, """
run_id: yaml-run
rollout:
  group_size: 6
  sampling:
    top_p: 0.9
intake:
  mode: sample
  num_groups: 3
rewards:
  weights:
    verifier: 2.0
""")
    settings = load_settings(yaml_file=path)
    assert settings.run_id == "yaml-run"
    assert settings.rollout.group_size == 6
    assert settings.rollout.sampling.top_p == 0.9
    assert settings.rollout.sampling.temperature == 1.0
    assert (settings.intake.mode, settings.intake.num_groups) == ("sample", 3)
    assert settings.rewards.weights == {"verifier": 2.0}
    # the file is handed on through CONVEYOR_CONFIG, so modules that load settings later see it too
    assert os.environ["CONVEYOR_CONFIG"] == str(path)
    assert load_settings().rollout.group_size == 6


def test_priority_keyword_then_env_then_yaml(tmp_path, monkeypatch):
    path = write_yaml(tmp_path, "run_id: from-yaml\nrollout:\n  group_size: 6\n  max_turns: 9\n")
    monkeypatch.setenv("CONVEYOR_ROLLOUT__GROUP_SIZE", "7")
    settings = load_settings(yaml_file=path)
    assert settings.rollout.group_size == 7  # env beats YAML
    assert settings.rollout.max_turns == 9  # YAML beats defaults
    assert load_settings(yaml_file=path, run_id="from-kw").run_id == "from-kw"  # keyword beats everything


def test_bad_env_value_names_the_field(monkeypatch):
    monkeypatch.setenv("CONVEYOR_ROLLOUT__GROUP_SIZE", "0")
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert "rollout.group_size" in str(info.value)
    assert "greater than 0" in str(info.value)


def test_bad_yaml_value_names_the_field(tmp_path):
    path = write_yaml(tmp_path, "rollout:\n  group_size: many\nledger:\n  max_attempts: -1\n")
    with pytest.raises(SettingsError) as info:
        load_settings(yaml_file=path)
    message = str(info.value)
    assert "rollout.group_size" in message and "ledger.max_attempts" in message


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"run_id": "has_underscore"}, "run_id"),
        ({"intake": {"mode": "random"}}, "intake.mode"),
        ({"storage": {"backend": "gcs"}}, "storage.backend"),
        ({"rollout": {"sampling": {"top_p": 1.5}}}, "rollout.sampling.top_p"),
        ({"inference": {"port": 70000}}, "inference.port"),
    ],
)
def test_bad_keyword_values_name_the_field(overrides, field):
    with pytest.raises(SettingsError, match=f"{field}:"):
        load_settings(**overrides)


def test_unknown_key_in_yaml_is_rejected(tmp_path):
    with pytest.raises(SettingsError, match="bogus"):
        load_settings(yaml_file=write_yaml(tmp_path, "bogus: 1\n"))
    with pytest.raises(SettingsError, match="rollout.gruop_size"):
        load_settings(yaml_file=write_yaml(tmp_path, "rollout:\n  gruop_size: 4\n", "typo.yaml"))


def test_missing_yaml_file_is_a_settings_error(tmp_path):
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings(yaml_file=tmp_path / "nope.yaml")


def test_settings_error_is_a_value_error_not_a_pydantic_traceback(monkeypatch):
    monkeypatch.setenv("CONVEYOR_LEDGER__LEASE_TTL_S", "soon")
    with pytest.raises(ValueError) as info:
        load_settings()
    assert type(info.value) is SettingsError
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert str(info.value).startswith("invalid Conveyor settings: ledger.lease_ttl_s")


def test_plain_settings_constructor_reads_env(monkeypatch):
    monkeypatch.setenv("CONVEYOR_TRAINER__SCALE_ADVANTAGE_BY_STD", "false")
    assert Settings().trainer.scale_advantage_by_std is False
