"""``agent_coding`` through the whole pipeline: intake, a real Celery rollout worker (its own
recording proxy, the agent in a real sandbox), the scorer and the trainer, on a real vLLM.
What the agent's model calls recorded is what the trainer trains on, masks included."""

from __future__ import annotations

import json
import shlex
import tempfile

import pytest
from pipeline_support import base_stack, run_stack, trained_trajectories
from test_agent_coding import SCRIPTED_AGENT

from shared.schemas import StopReason

pytestmark = pytest.mark.slow

GROUP_SIZE = 2


def test_agent_trajectories_reach_the_trainer_with_their_recorded_tokens_and_masks(
        tmp_path, swe_bench_row, python_image, coding_run_id, docker_client, served_model):
    dataset = tmp_path / "swe.jsonl"
    dataset.write_text(json.dumps(swe_bench_row) + "\n")
    env_config = {"image": python_image, "workspace_cache_dir": str(tmp_path / "workspaces"), "test_timeout_s": 60,
                  "agent_timeout_s": 180, "agent_command": f"python3 -c {shlex.quote(SCRIPTED_AGENT)}"}
    run_id = coding_run_id
    with base_stack(tmp_path, served_model) as base, tempfile.TemporaryDirectory(prefix="ag-", dir="/tmp") as sockets:
        stack = run_stack(base, tmp_path / "run", run_id, CONVEYOR_INTAKE__ENV_NAME="agent_coding",
                          CONVEYOR_INTAKE__ENV_CONFIG=json.dumps(env_config), CONVEYOR_ROLLOUT__GROUP_SIZE=str(GROUP_SIZE),
                          CONVEYOR_REWARDS__WEIGHTS=json.dumps({"verifier": 1.0}),
                          CONVEYOR_TRAINER__ZERO_VARIANCE_GROUPS="keep", CONVEYOR_ROLLOUT__AGENT_SOCKET_DIR=sockets)
        with stack:
            _, pairs = trained_trajectories(stack, run_id, dataset, GROUP_SIZE)
            for sample, trajectory in pairs:
                assert trajectory.stop_reason is StopReason.done and trajectory.env_reward == 1.0, trajectory.env_info.get("agent")
                assert len(trajectory.turns) == 2 and sample.reward == pytest.approx(1.0)
