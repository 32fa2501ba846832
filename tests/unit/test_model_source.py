"""``inference.model_path`` read as a local checkpoint or a Hugging Face model name
(shared/model_source.py), and the vLLM command line built from it (services/inference/vllm_command.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.inference.vllm_command import InferenceServerError, build_command, settings_options
from shared.model_source import ModelSourceError, resolve_model_source
from shared.settings import load_settings


def test_a_directory_is_a_local_checkpoint_whatever_its_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for value, expected in ((tmp_path / "org", tmp_path / "org"), ("org/name", Path("org/name")),
                            ("./org/name", Path("org/name"))):
        source = resolve_model_source(value)
        assert source.local_dir == expected and not source.is_hub_name
        assert source.value == str(expected)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model_source("~/org").local_dir == tmp_path / "org"  # expanded before vLLM sees it


def test_an_org_slash_name_that_is_no_directory_is_a_hub_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    source = resolve_model_source("Qwen/Qwen2.5-0.5B-Instruct")
    assert source.is_hub_name and source.value == "Qwen/Qwen2.5-0.5B-Instruct"
    assert "is not a local directory: it is used as a Hugging Face model name" in source.describe()


@pytest.mark.parametrize("value", ["/no/such/checkpoint", "./org/name", "../org/name", "~/no-such-model"])
def test_a_path_that_is_not_a_directory_is_refused_naming_the_setting(value: str, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelSourceError, match=r"^inference\.model_path: .* is not a directory"):
        resolve_model_source(value)


def test_an_existing_file_is_not_sent_to_the_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "weights").write_text("not a checkpoint directory")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelSourceError, match=r"inference\.model_path: org/weights is not a directory"):
        resolve_model_source("org/weights")


@pytest.mark.parametrize("value", ["qwen", "a/b/c", "has space/name", "org/na--me", "org/name.git", "-org/name", "org/"])
def test_a_malformed_value_is_refused_naming_the_setting(value: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelSourceError, match=r"^inference\.model_path: .* is neither a local directory nor a "
                                               r"Hugging Face model name \(org/name"):
        resolve_model_source(value)


def test_an_empty_value_is_refused_naming_the_setting() -> None:
    with pytest.raises(ModelSourceError, match=r"^inference\.model_path is empty"):
        resolve_model_source("  ")


def test_the_settings_keep_a_path_as_written() -> None:
    assert load_settings(inference={"model_path": "./models/tiny"}).inference.model_path == "./models/tiny"
    assert load_settings(inference={"model_path": Path("/m")}).inference.model_path == "/m"


def test_settings_reach_the_gpu_command_line_and_the_cpu_one_has_no_gpu_flags() -> None:
    settings = load_settings(inference={"model_path": "Qwen/Qwen2.5-7B-Instruct", "tensor_parallel_size": 4,
                                        "gpu_memory_utilization": 0.6, "dtype": "bfloat16"})
    argv, env = build_command(**settings_options(settings.inference), gpu=True)
    for flag, value in (("--model", "Qwen/Qwen2.5-7B-Instruct"), ("--tensor-parallel-size", "4"),
                        ("--gpu-memory-utilization", "0.6"), ("--dtype", "bfloat16")):
        assert argv[argv.index(flag) + 1] == value, flag
    assert "--max-num-seqs" not in argv and "VLLM_CPU_KVCACHE_SPACE" not in env

    cpu = load_settings(inference={"model_path": "Qwen/Qwen2.5-0.5B-Instruct"})
    argv, env = build_command(**settings_options(cpu.inference), gpu=False)
    assert argv[argv.index("--model") + 1] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert "--tensor-parallel-size" not in argv and "--gpu-memory-utilization" not in argv
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    with pytest.raises(InferenceServerError, match=r"tensor parallelism \(4\) needs GPUs; this host has none"):
        build_command(**settings_options(settings.inference), gpu=False)


def test_the_command_line_refuses_a_bad_model_path_naming_the_setting(tmp_path: Path) -> None:
    settings = load_settings(inference={"model_path": str(tmp_path / "missing")})
    with pytest.raises(ModelSourceError, match=r"^inference\.model_path: .*missing is not a directory"):
        settings_options(settings.inference)
