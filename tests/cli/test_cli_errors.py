"""The real ``conveyor`` command, run as a subprocess: a known failure is one line on stderr
naming its cause and exit code 2; ``--debug`` shows the traceback instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.cli.local_stack import free_port

CONVEYOR = str(Path(sys.executable).parent / "conveyor")  # the installed entry point


def conveyor(*args: str, cwd: Path, timeout_s: float = 60, **env: str) -> subprocess.CompletedProcess:
    """Run in an empty directory (no ./.env) with only the CONVEYOR_* variables given."""
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONVEYOR_")}
    return subprocess.run([CONVEYOR, *args], cwd=cwd, env={**base, **env}, capture_output=True, text=True, timeout=timeout_s)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0].removeprefix("error: ")


def closed_port_url(password: str = "") -> str:
    auth = f":{password}@" if password else ""
    return f"redis://{auth}127.0.0.1:{free_port()}/0"  # nothing listens on a port free_port just released


def test_redis_unreachable_names_the_url_without_its_password(tmp_path):
    url = closed_port_url("s3cret-pw")  # a one-shot command fails at once (services wait: tests/cli/test_cli_outage.py)
    line = one_error_line(conveyor("status", cwd=tmp_path, CONVEYOR_REDIS__URL=url))
    assert line.startswith(f"Redis unreachable at {url.replace('s3cret-pw', '***')}: ")
    assert "Connection refused" in line and "s3cret-pw" not in line


def test_debug_flag_shows_the_traceback_instead(tmp_path):
    result = conveyor("--debug", "status", cwd=tmp_path, CONVEYOR_REDIS__URL=closed_port_url())
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "ConnectionError" in result.stderr
    assert "error: Redis unreachable" not in result.stderr




def test_malformed_yaml_names_the_file_and_line(tmp_path):
    config = tmp_path / "conveyor.yaml"
    config.write_text("run_id: ok\nrollout:\n  group_size: 4\n   max_turns: 2\n")
    line = one_error_line(conveyor("status", "--config", str(config), cwd=tmp_path))
    assert line.startswith(f"{config}:4: not valid YAML: ")


@pytest.mark.parametrize(
    "args, env, expected",
    [
        (["status"], {"CONVEYOR_REWARDS__WEIGHTS": '{"verifier": 1,'},
         "environment variable CONVEYOR_REWARDS__WEIGHTS is not valid JSON: "),
        (["status"], {"CONVEYOR_LOG_LEVEL": "LOUD"},
         "CONVEYOR_LOG_LEVEL: unknown log level 'LOUD'; use DEBUG, INFO, WARNING, ERROR or CRITICAL"),
        (["worker", "rollout", "--loglevel", "CHATTY"], {"CONVEYOR_INFERENCE__MODEL_PATH": "."},
         "--loglevel: unknown log level 'CHATTY'"),
        (["status"], {"CONVEYOR_ROLLOUT__GROUP_SIZE": "0"},
         "invalid Conveyor settings: rollout.group_size: Input should be greater than 0"),
        (["status"], {"CONVEYOR_ROLOUT__GROUP_SIZE": "8"},
         "unknown environment variable CONVEYOR_ROLOUT__GROUP_SIZE: did you mean CONVEYOR_ROLLOUT__GROUP_SIZE?"),
        (["intake"], {"CONVEYOR_INTAKE__ENV_CONFIG": '{"reward_fn": "no_such_module_xyz:score"}'},
         "invalid Conveyor settings: intake.env_config: reward_fn 'no_such_module_xyz:score' cannot be imported: "
         "ModuleNotFoundError: No module named 'no_such_module_xyz'"),
    ],
)
def test_settings_and_option_failures_are_one_line(tmp_path, args, env, expected):
    assert one_error_line(conveyor(*args, cwd=tmp_path, **env)).startswith(expected)


def test_yaml_boolean_for_a_number_names_the_field(tmp_path):
    config = tmp_path / "conveyor.yaml"
    config.write_text("rollout:\n  group_size: true\n")
    line = one_error_line(conveyor("status", "-c", str(config), cwd=tmp_path))
    assert line == "invalid Conveyor settings: rollout.group_size: must be a number, not a boolean"


def test_missing_model_path_names_the_setting(tmp_path):
    missing = tmp_path / "no-model"
    line = one_error_line(conveyor("worker", "rollout", cwd=tmp_path, CONVEYOR_INFERENCE__MODEL_PATH=str(missing)))
    assert line.startswith(f"inference.model_path: {missing} is not a directory")


def test_a_malformed_model_path_names_the_setting(tmp_path):
    line = one_error_line(conveyor("trainer", cwd=tmp_path, CONVEYOR_TRAINER__MAX_OFF_POLICY_STEPS="0",
                                   CONVEYOR_INFERENCE__MODEL_PATH="org/name/extra"))
    assert line.startswith("inference.model_path: 'org/name/extra' is neither a local directory nor a Hugging Face "
                           "model name (org/name")


def conveyor_from_here(*args: str, cwd: Path, timeout_s: float = 60, **env: str) -> subprocess.CompletedProcess:
    """``conveyor`` as ``python -m services.cli.app`` from this checkout, like ``conveyor``."""
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith(("CONVEYOR_", "HF_"))}
    return subprocess.run([sys.executable, "-m", "services.cli.app", *args], cwd=cwd, capture_output=True, text=True,
                          env={**base, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), **env}, timeout=timeout_s)


def not_available(name: str, hf_home: Path, why: str) -> str:
    return (f"inference.model_path: {name} is neither a local directory nor in the local Hugging Face cache "
            f"({hf_home / 'hub'}), and {why}: download it first (`hf download {name}`) or set inference.model_path "
            "to a local checkpoint directory")


@pytest.mark.parametrize("args", [["inference"], ["trainer"], ["worker", "rollout"]])
def test_a_hub_name_not_cached_offline_is_one_line_naming_it(tmp_path, args):
    """Offline (HF_HUB_OFFLINE), a made-up model name stops every command that loads the model
    before anything starts, naming the model, the cache and the cure (issue 24: a 278-line traceback)."""
    hf_home = tmp_path / "hf-home"
    line = one_error_line(conveyor_from_here(*args, cwd=tmp_path, CONVEYOR_INFERENCE__MODEL_PATH="conveyor-test/not-cached",
                                             CONVEYOR_TRAINER__MAX_OFF_POLICY_STEPS="1", HF_HUB_OFFLINE="1",
                                             HF_HOME=str(hf_home)))
    assert line == not_available("conveyor-test/not-cached", hf_home, "the Hub is offline (HF_HUB_OFFLINE)")


def test_a_hub_name_not_cached_with_the_hub_unreachable_is_one_line_naming_it(tmp_path):
    """No HF_HUB_OFFLINE, but nothing answers at the Hub's endpoint: the same one line, saying so."""
    hf_home, endpoint = tmp_path / "hf-home", f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    line = one_error_line(conveyor_from_here("trainer", cwd=tmp_path, CONVEYOR_INFERENCE__MODEL_PATH="conveyor-test/made-up",
                                             CONVEYOR_TRAINER__MAX_OFF_POLICY_STEPS="1", CONVEYOR_OUTAGE__LIMIT_S="1",
                                             HF_ENDPOINT=endpoint, HF_HOME=str(hf_home)))
    prefix, _, rest = line.partition(f", and the Hub at {endpoint} is unreachable (")
    assert prefix == not_available("conveyor-test/made-up", hf_home, "").split(", and ")[0], line
    assert "HF_HUB_OFFLINE=1 says offline at once): download it first (`hf download conveyor-test/made-up`)" in rest
    assert time.monotonic() - started < 30


def test_the_gpu_launch_takes_a_hub_name_from_the_cache_offline(tmp_path):
    """A model name in the Hub cache is enough offline: the GPU launcher (compose's inference-gpu)
    builds vLLM's command with it, and its log says the name goes to vLLM as a hub name."""
    hf_home = tmp_path / "hf-home"
    snapshot = hf_home / "hub" / "models--conveyor-test--cached" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (hf_home / "hub" / "models--conveyor-test--cached" / "refs").mkdir()
    (hf_home / "hub" / "models--conveyor-test--cached" / "refs" / "main").write_text("0" * 40)
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONVEYOR_")}
    result = subprocess.run([sys.executable, "-m", "services.inference.gpu_launch", "--print"], cwd=tmp_path,
                            env={**base, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "HF_HUB_OFFLINE": "1",
                                 "HF_HOME": str(hf_home), "CONVEYOR_INFERENCE__MODEL_PATH": "conveyor-test/cached"},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "conveyor-test/cached is not a local directory: it is used as a Hugging Face model name" in result.stderr
    argv = json.loads(result.stdout)["argv"]
    assert argv[argv.index("--model") + 1] == "conveyor-test/cached"


def test_unknown_dataset_file_names_the_path(tmp_path):
    line = one_error_line(conveyor("intake", "--dataset", str(tmp_path / "nope.jsonl"), cwd=tmp_path))
    assert line == f"dataset {tmp_path / 'nope.jsonl'} does not exist"


def test_demo_refuses_zero_tasks_at_once(tmp_path):
    started = time.monotonic()
    result = conveyor("demo", "--tasks", "0", cwd=tmp_path, timeout_s=30)
    assert result.returncode == 2
    assert "Invalid value for '--tasks'" in result.stderr and "greater than or equal to 1" in result.stderr
    assert time.monotonic() - started < 30 and not (tmp_path / ".conveyor").exists()  # nothing was started


def test_the_same_command_succeeds_when_redis_is_there(tmp_path, redis_url):
    result = conveyor("status", "--json", cwd=tmp_path, CONVEYOR_REDIS__URL=redis_url)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith('{"runs": ')


@pytest.mark.parametrize("url, shown", [
    ("redis://:pw@redis:6379/0", "redis://:***@redis:6379/0"),
    ("rediss://user:p@ss:w@host:6380/1", "rediss://user:***@host:6380/1"),
    ("redis://user@host:6379/0", "redis://user@host:6379/0"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
])
def test_redis_urls_are_shown_without_their_password(url, shown):
    from services.cli.errors import redact_url

    assert redact_url(url) == shown


def test_a_run_whose_replica_cannot_serve_its_base_weights_does_not_start(tmp_path, redis_url):
    from services.inference.tiny_model import generate_tiny_model

    replica = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = conveyor_from_here("inference", "--attach", "--replica", replica, cwd=tmp_path, timeout_s=120,
                                CONVEYOR_REDIS__URL=redis_url, CONVEYOR_RUN_ID="base-check",
                                CONVEYOR_STORAGE__BACKEND="local", CONVEYOR_STORAGE__LOCAL_ROOT=str(tmp_path / "objects"),
                                CONVEYOR_INFERENCE__MODEL_PATH=str(generate_tiny_model(tmp_path / "tiny")))
    assert result.returncode == 2, result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith("error: run base-check cannot start") and f"replica {replica}" in last, result.stderr
