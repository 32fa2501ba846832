"""Settings: sources and their priority, and SettingsError naming the bad field."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared.settings import (
    AssembleTrainerSettings,
    LocalStorageSettings,
    S3StorageSettings,
    Settings,
    SettingsError,
    TrainTrainerSettings,
    assembling,
    load_settings,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No CONVEYOR_* variables from the outside, and none left behind (load_settings sets
    CONVEYOR_CONFIG); the current directory is empty, so no stray ./.env is read."""
    monkeypatch.setenv("CONVEYOR_CONFIG", "placeholder")  # recorded, so it is removed again after the test
    for name in list(os.environ):
        if name.startswith("CONVEYOR_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


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
        ({"trainer": {"lora": {"rank": 0}}}, "trainer.lora.rank"),
        ({"trainer": {"lora": {"alpha": 0}}}, "trainer.lora.alpha"),
        ({"trainer": {"lora": {"target_modules": []}}}, "trainer.lora.target_modules"),
        ({"trainer": {"lora": {"target_modules": ["q_proj", "q_proj"]}}}, "trainer.lora.target_modules"),
        ({"trainer": {"lora": {"sync": "delta"}}}, "trainer.lora.sync"),
        ({"trainer": {"lora": {"sync": "adapter", "rank": 1024}}}, "trainer.lora"),
        ({"inference": {"weight_sync": "rdma"}}, "inference.weight_sync.mode"),
        ({"inference": {"weight_sync": {"mode": "delta", "encode_on": "gpu"}}}, "inference.weight_sync.delta.encode_on"),
        ({"storage": {"backend": "local", "endpoint": "s3:9000"}}, "storage.local.endpoint"),
        ({"storage": {"local_root": "objects"}}, "storage.s3.local_root"),
    ],
)
def test_bad_keyword_values_name_the_field(overrides, field):
    with pytest.raises(SettingsError, match=f"{field}:"):
        load_settings(**overrides)


def test_storage_is_s3_unless_its_backend_says_local(monkeypatch, tmp_path):
    monkeypatch.setenv("CONVEYOR_STORAGE__ENDPOINT", "s3:9000")  # as compose/worker-host.yml sets it, no backend
    assert load_settings().storage == S3StorageSettings(endpoint="s3:9000")
    monkeypatch.delenv("CONVEYOR_STORAGE__ENDPOINT")
    monkeypatch.setenv("CONVEYOR_STORAGE__BACKEND", "local")
    monkeypatch.setenv("CONVEYOR_STORAGE__LOCAL_ROOT", str(tmp_path))
    assert load_settings().storage == LocalStorageSettings(local_root=tmp_path)
    monkeypatch.setenv("CONVEYOR_STORAGE__BUCKET", "b")  # an s3 field with the local backend
    with pytest.raises(SettingsError, match="storage.local.bucket: Extra inputs are not permitted"):
        load_settings()


def test_the_trainer_trains_only_in_mode_train_which_needs_a_staleness_bound(monkeypatch):
    assert load_settings().trainer.mode == "assemble"
    assert load_settings(trainer={"mode": "train", "max_off_policy_steps": 0}).trainer.mode == "train"
    assert load_settings(trainer={"mode": "assemble", "max_off_policy_steps": 1}).trainer.mode == "assemble"
    with pytest.raises(SettingsError, match="trainer.max_off_policy_steps: Field required"):
        load_settings(trainer={"mode": "train"})
    monkeypatch.setenv("CONVEYOR_TRAINER__MAX_OFF_POLICY_STEPS", "1")  # a config from before trainer.mode
    assert load_settings().trainer.mode == "train"


def test_train_only_settings_are_fields_of_the_train_mode_and_refused_naming_it_in_assemble(monkeypatch, tmp_path):
    trainer = load_settings(trainer={"max_off_policy_steps": 2, "groups_per_step": 3, "max_steps": 5}).trainer
    assert isinstance(trainer, TrainTrainerSettings) and (trainer.groups_per_step, trainer.max_steps) == (3, 5)
    assert not hasattr(load_settings().trainer, "groups_per_step")  # assemble has no step to size
    with pytest.raises(SettingsError, match="trainer: max_steps is a setting of trainer.mode train: set trainer.mode: train"):
        load_settings(trainer={"max_steps": 5})
    with pytest.raises(SettingsError, match="trainer.lora.rank: Input should be greater than 0"):  # no mode in the place
        load_settings(trainer={"mode": "train", "max_off_policy_steps": 0, "lora": {"rank": 0}})
    assembled = assembling(trainer.model_copy(update={"zero_variance_groups": "keep"}))
    assert isinstance(assembled, AssembleTrainerSettings) and assembled.zero_variance_groups == "keep"
    config = tmp_path / "conveyor.yaml"  # the YAML and variables users write keep working
    config.write_text("trainer:\n  mode: train\n  max_off_policy_steps: 1\n  min_env_share: {a: 0.5}\n")
    monkeypatch.setenv("CONVEYOR_TRAINER__GROUPS_PER_STEP", "2")
    trainer = load_settings(config).trainer
    assert isinstance(trainer, TrainTrainerSettings) and (trainer.groups_per_step, trainer.min_env_share) == (2, {"a": 0.5})


@pytest.mark.parametrize("sync", ["merged", "adapter"])
def test_nccl_weight_sync_with_lora_is_refused(sync):
    with pytest.raises(SettingsError, match="weight_sync: nccl does not support trainer.lora"):
        load_settings(inference={"weight_sync": "nccl"}, trainer={"lora": {"enabled": True, "sync": sync}})
    load_settings(inference={"weight_sync": "s3"}, trainer={"lora": {"enabled": True, "sync": sync}})
    load_settings(inference={"weight_sync": "nccl"})


def test_delta_weight_sync_carries_merged_lora_and_refuses_an_adapter():
    with pytest.raises(SettingsError, match="weight_sync: delta does not support trainer.lora.sync: adapter"):
        load_settings(inference={"weight_sync": "delta"}, trainer={"lora": {"enabled": True, "sync": "adapter"}})
    load_settings(inference={"weight_sync": "delta"}, trainer={"lora": {"enabled": True, "sync": "merged"}})
    assert load_settings(inference={"weight_sync": "delta"}).inference.weight_sync.encode_on == "host"
    assert load_settings(inference={"weight_sync": {"mode": "delta", "encode_on": "device"}}
                         ).inference.weight_sync.encode_on == "device"


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


# --- strictness: unknown names, booleans, .env, YAML syntax, JSON, import paths ----------------

ROOT = Path(__file__).resolve().parents[2]
# typos that tests and the README use on purpose, to show they are refused
DELIBERATE_TYPOS = {"CONVEYOR_ROLOUT__GROUP_SIZE", "CONVEYOR_ROLLOUT__GRUOP_SIZE"}


def test_unknown_env_variable_is_refused_naming_it_and_the_closest_name(monkeypatch):
    monkeypatch.setenv("CONVEYOR_ROLOUT__GROUP_SIZE", "8")
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert str(info.value) == (
        "unknown environment variable CONVEYOR_ROLOUT__GROUP_SIZE: did you mean CONVEYOR_ROLLOUT__GROUP_SIZE?"
    )
    monkeypatch.delenv("CONVEYOR_ROLOUT__GROUP_SIZE")
    monkeypatch.setenv("CONVEYOR_ROLLOUT__GRUOP_SIZE", "8")  # a typo below a real section
    with pytest.raises(SettingsError, match="CONVEYOR_ROLLOUT__GRUOP_SIZE: did you mean CONVEYOR_ROLLOUT__GROUP_SIZE"):
        Settings()  # the plain constructor checks too


def test_allow_listed_variables_and_dict_entries_are_accepted(monkeypatch):
    from shared.settings_sources import ALLOWED_VARIABLES

    for name in ALLOWED_VARIABLES - {"CONVEYOR_CONFIG"}:  # CONVEYOR_CONFIG must name a real file
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("CONVEYOR_LOG_LEVEL", "INFO")
    monkeypatch.setenv("CONVEYOR_REWARDS__WEIGHTS__VERIFIER", "2")  # an entry of a dict setting
    monkeypatch.setenv("CONVEYOR_INTAKE__ENV_CONFIG__MAX_TURNS", "1")
    settings = load_settings()
    assert settings.rewards.weights["verifier"] == 2.0
    assert settings.intake.env_config == {"max_turns": "1"}
    assert settings.rollout.group_size == 4  # CONVEYOR_GROUP_SIZE (compose's name) sets nothing


def _conveyor_names_in(paths: list[Path]) -> dict[str, str]:
    import re

    found: dict[str, str] = {}
    for path in paths:
        for name in re.findall(r"\bCONVEYOR_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")):
            found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_every_conveyor_variable_the_repository_uses_is_known_and_every_allowed_one_is_used():
    """The allow-list is complete (nothing the compose files, scripts, code or tests set becomes
    "unknown") and has no dead entries."""
    from shared.settings_sources import ALLOWED_VARIABLES, env_problem

    files = [p for pattern in ("compose/*.yml", "compose/.env.example", "scripts/*", ".ci/*", "Makefile", "README.md",
                               "docs/*.md", "services/**/*.py", "shared/**/*.py", "bench/**/*.py", "tests/**/*.py")
             for p in ROOT.glob(pattern) if p.is_file()]
    used = _conveyor_names_in(files)
    assert "CONVEYOR_METRICS_PORT" in used and "CONVEYOR_DEMO_TASKS" in used  # the scan sees compose and code
    unknown = {name: where for name, where in used.items() if name not in DELIBERATE_TYPOS and env_problem(Settings, name)}
    assert unknown == {}
    assert sorted(ALLOWED_VARIABLES - used.keys()) == []


@pytest.mark.parametrize(
    "yaml_text, overrides, field",
    [
        ("rollout:\n  group_size: true\n", {}, "rollout.group_size"),
        ("trainer:\n  optim:\n    lr: false\n", {}, "trainer.optim.lr"),
        ("metrics_port: true\n", {}, "metrics_port"),
        ("", {"rewards": {"weights": {"verifier": True}}}, "rewards.weights.verifier"),
        ("", {"trainer": {"optim": {"betas": [True, 0.9]}}}, "trainer.optim.betas.0"),
    ],
)
def test_numbers_refuse_booleans(tmp_path, yaml_text, overrides, field):
    path = write_yaml(tmp_path, yaml_text or "{}\n")
    with pytest.raises(SettingsError, match=f"{field}: must be a number, not a boolean"):
        load_settings(yaml_file=path, **overrides)


def test_numbers_in_env_strings_still_parse_but_words_do_not(monkeypatch):
    monkeypatch.setenv("CONVEYOR_ROLLOUT__GROUP_SIZE", "8")
    monkeypatch.setenv("CONVEYOR_TRAINER__OPTIM__LR", "1e-5")
    settings = load_settings()
    assert (settings.rollout.group_size, settings.trainer.optim.lr) == (8, 1e-5)
    monkeypatch.setenv("CONVEYOR_ROLLOUT__GROUP_SIZE", "true")
    with pytest.raises(SettingsError, match="rollout.group_size: Input should be a valid integer"):
        load_settings()


def test_dotenv_in_the_current_directory_sits_between_the_environment_and_yaml(tmp_path, monkeypatch):
    (tmp_path / ".env").write_text(
        "# settings for this directory\n"
        "CONVEYOR_ROLLOUT__GROUP_SIZE=7\n"
        "CONVEYOR_RUN_ID=from-dotenv\n"
        "export CONVEYOR_LEDGER__MAX_ATTEMPTS=5\n"
        "REDIS_PASSWORD=not-ours\n"  # another tool's name: ignored
        "CONVEYOR_GROUP_SIZE=4\n"  # compose's name: ignored
    )
    path = write_yaml(tmp_path, "run_id: from-yaml\nrollout:\n  group_size: 6\n  max_turns: 9\n")
    settings = load_settings(yaml_file=path)
    assert (settings.rollout.group_size, settings.run_id, settings.ledger.max_attempts) == (7, "from-dotenv", 5)
    assert settings.rollout.max_turns == 9  # YAML still fills what .env does not set
    monkeypatch.setenv("CONVEYOR_ROLLOUT__GROUP_SIZE", "9")
    assert load_settings(yaml_file=path).rollout.group_size == 9  # the environment beats .env


@pytest.mark.parametrize(
    "text, message",
    [
        ("CONVEYOR_ROLOUT__GROUP_SIZE=3\n", "unknown variable CONVEYOR_ROLOUT__GROUP_SIZE in {env}: did you mean CONVEYOR_ROLLOUT__GROUP_SIZE?"),
        ("CONVEYOR_LOG_LEVEL=DEBUG\n", "CONVEYOR_LOG_LEVEL in {env} has no effect there: set it in the environment"),
        ('CONVEYOR_INTAKE__ENV_CONFIG={"a": 1\n', "variable CONVEYOR_INTAKE__ENV_CONFIG in {env} is not valid JSON"),
        ("CONVEYOR_RUN_ID=ok\nthis line is not an assignment\n", "{env}:2: not a NAME=value line"),
    ],
)
def test_dotenv_problems_name_the_file(tmp_path, text, message):
    env = tmp_path / ".env"
    env.write_text(text)
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert str(info.value).startswith(message.format(env=env))


def test_yaml_syntax_error_names_the_file_and_line(tmp_path):
    path = write_yaml(tmp_path, "run_id: ok\nrollout:\n  group_size: [4,\n")
    with pytest.raises(SettingsError, match=f"^{path}:4: not valid YAML"):
        load_settings(yaml_file=path)
    with pytest.raises(SettingsError, match="the top level must map setting names to values"):
        load_settings(yaml_file=write_yaml(tmp_path, "- rollout\n", "list.yaml"))


@pytest.mark.parametrize("name, value", [
    ("CONVEYOR_INTAKE__ENV_CONFIG", "{reward_fn: x}"),
    ("CONVEYOR_REWARDS__WEIGHTS", '{"verifier": 1,'),
    ("CONVEYOR_TRAINER__OPTIM__BETAS", "0.9,0.99"),
    ("CONVEYOR_ROLLOUT", "group_size=3"),
])
def test_bad_json_in_an_env_variable_names_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match=f"^environment variable {name} is not valid JSON: "):
        load_settings()


def test_import_paths_are_checked_at_start_naming_the_setting(tmp_path):
    with pytest.raises(SettingsError) as info:
        load_settings(intake={"env_config": {"reward_fn": "no_such_module_xyz:score"}})
    assert str(info.value) == ("invalid Conveyor settings: intake.env_config: reward_fn 'no_such_module_xyz:score' "
                               "cannot be imported: ModuleNotFoundError: No module named 'no_such_module_xyz'")
    with pytest.raises(SettingsError, match="rewards.weights: reward function 'math:nope' cannot be imported: AttributeError"):
        load_settings(rewards={"weights": {"verifier": 1.0, "math:nope": 0.5}})
    with pytest.raises(SettingsError, match="intake.env_config: reward_fn 'no_colon' must look like 'package.module:function'"):
        load_settings(intake={"env_config": {"reward_fn": "no_colon"}})
    good = "services.rollout_worker.environments.toy_rewards:digit_share"
    assert load_settings(intake={"env_config": {"reward_fn": good}}, rewards={"weights": {"math:sqrt": 1.0}}).intake.env_config["reward_fn"] == good


def test_conveyor_config_naming_a_missing_file_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CONVEYOR_CONFIG", str(tmp_path / "nope.yaml"))
    with pytest.raises(SettingsError, match="nope.yaml \\(CONVEYOR_CONFIG\\) does not exist"):
        load_settings()


def test_the_agent_proxys_bounds_load_from_the_environment_and_name_a_bad_one(monkeypatch):
    monkeypatch.setenv("CONVEYOR_ROLLOUT__AGENT_PROXY__SESSION_CONNECTIONS", "4")
    assert load_settings().rollout.agent_proxy.session_connections == 4
    assert load_settings().rollout.agent_proxy.max_body_bytes == 8 * 1024 * 1024  # siblings keep their defaults
    monkeypatch.setenv("CONVEYOR_ROLLOUT__AGENT_PROXY__HEADER_TIMEOUT_S", "0")
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert "rollout.agent_proxy.header_timeout_s" in str(info.value) and "greater than 0" in str(info.value)


def test_a_cluster_ledger_needs_a_standalone_broker_of_its_own():
    with pytest.raises(SettingsError, match="redis.broker_url: the Celery broker needs a standalone Redis"):
        load_settings(redis={"url": "redis+cluster://127.0.0.1:7000"})
    settings = load_settings(redis={"url": "redis+cluster://127.0.0.1:7000", "broker_url": "redis://127.0.0.1:6380/0"})
    assert settings.redis.broker == "redis://127.0.0.1:6380/0"
    assert load_settings(redis={"url": "redis://h:1/0"}).redis.broker == "redis://h:1/0"  # one Redis for both
