"""Cline through the whole pipeline: intake, a real Celery rollout worker (its proxy, Cline and
its driver in real sandboxes), the scorer and the trainer, whose batch must hold exactly the
recorded tokens, masks and logprobs.

- Against the real tiny policy on vLLM: Cline's nonsense calls reach the trainer; reward 0.
- Scoring 1.0: the policy is the one thing stood in for. A scripted server answers vLLM's token
  API (``scripted_completions``) with a known-good conversation, encoded with the tiny model's
  tokenizer: Cline writes the fixed ``calc/__init__.py`` with ``<write_to_file>``, then ends with
  ``<attempt_completion>``, and the hidden tests give 1.0.
"""

from __future__ import annotations

import json
import tempfile
from contextlib import contextmanager

import pytest
from agent_support import LONG_CONTEXT, long_context_tiny_model
from coding_helpers import CALC
from pipeline_support import ServedModel, base_stack, run_stack, trained_trajectories
from scripted_completions import scripted_completions

from shared.schemas import StopReason

pytestmark = pytest.mark.slow

GROUP_SIZE = 2
CONTEXT = LONG_CONTEXT  # Cline's system prompt is about 33,000 of the tiny model's tokens
FIXED_CALC = CALC.replace("def add(a, b):\n    return a - b", "def add(a, b):\n    return a + b").replace(
    "def mul(a, b):\n    return a + b", "def mul(a, b):\n    return a * b")
REPLIES = [
    f"I will fix add and mul.\n\n<write_to_file>\n<path>calc/__init__.py</path>\n<content>\n{FIXED_CALC}</content>\n"
    "</write_to_file>",
    "<attempt_completion>\n<result>add and mul now add and multiply.</result>\n</attempt_completion>",
]


@contextmanager
def cline_run(tmp_path, swe_bench_row, cline_image, run_id, served: ServedModel, **settings: str):
    """A stack whose rollout worker runs Cline on the calc task, with room for Cline's prompt in
    the rollout's limits and in the trainer's sequences; yields ``(stack, dataset)``."""
    dataset = tmp_path / "swe.jsonl"
    dataset.write_text(json.dumps(swe_bench_row) + "\n")
    env_config = {"image": cline_image, "workspace_cache_dir": str(tmp_path / "workspaces"), "test_timeout_s": 60,
                  "agent_timeout_s": 300, "agent_command": "python3 -m agent_drivers.cline",
                  "agent_artifacts_dir": "/tmp/agent-artifacts"}
    with base_stack(tmp_path, served) as base, tempfile.TemporaryDirectory(prefix="ag-", dir="/tmp") as sockets:
        stack = run_stack(base, tmp_path / "run", run_id, CONVEYOR_INTAKE__ENV_NAME="agent_coding",
                          CONVEYOR_INTAKE__ENV_CONFIG=json.dumps(env_config), CONVEYOR_ROLLOUT__GROUP_SIZE=str(GROUP_SIZE),
                          CONVEYOR_REWARDS__WEIGHTS=json.dumps({"verifier": 1.0}),
                          CONVEYOR_TRAINER__ZERO_VARIANCE_GROUPS="keep", CONVEYOR_ROLLOUT__AGENT_SOCKET_DIR=sockets,
                          CONVEYOR_INFERENCE__MAX_MODEL_LEN=str(CONTEXT), CONVEYOR_TRAINER__BATCHING__MAX_SEQ_LEN=str(CONTEXT),
                          CONVEYOR_TRAINER__BATCHING__MICRO_BATCH_TOKENS=str(CONTEXT), CONVEYOR_TRAINER__TORCH_THREADS="1",
                          **settings)
        with stack:
            yield stack, dataset


def test_cline_fixes_the_bug_through_the_pipeline_and_scores_1(tmp_path, swe_bench_row, cline_image, coding_run_id):
    model_dir = long_context_tiny_model(tmp_path / "tiny", CONTEXT)
    run_id = coding_run_id
    with scripted_completions(model_dir, "tiny", REPLIES) as policy, \
            cline_run(tmp_path, swe_bench_row, cline_image, run_id, ServedModel(policy.base_url, model_dir),
                      CONVEYOR_ROLLOUT__MAX_TOKENS_PER_TURN="512", CONVEYOR_ROLLOUT__MAX_EPISODE_TOKENS="2048",
                      CONVEYOR_ROLLOUT__MAX_TURNS="6",
                      # the stand-in's logprobs are made up, not the tiny model's: no alarm on them
                      CONVEYOR_TRAINER__LOGPROB_ALARM__MAX_ON_POLICY_MAD="1000",
                      CONVEYOR_TRAINER__LOGPROB_ALARM__MAX_ON_POLICY_MISMATCH_KL="1000") as (stack, dataset):
        store, pairs = trained_trajectories(stack, run_id, dataset, GROUP_SIZE, timeout_s=900)
        for sample, trajectory in pairs:
            agent = trajectory.env_info["agent"]
            print(f"\n{sample.trajectory_id}: {json.dumps(agent['metrics'])}; first call after {agent['first_call_s']} s")
            assert agent["metrics"]["outcome"] == "completed", agent
            assert trajectory.stop_reason is StopReason.done and trajectory.env_reward == 1.0, trajectory.env_info.get("tests")
            assert len(trajectory.turns) == 2 and not trajectory.turns[1].segment_start
            assert [t.completion_text for t in trajectory.turns] == REPLIES
            assert sample.reward == pytest.approx(1.0)
            history = json.loads(store.get_bytes(agent["artifacts"]["api_conversation_history.json"]))
            # Cline records a reply when the next request goes out: the closing one is not there
            assert [m["role"] for m in history] == ["user", "assistant", "user"] and "<write_to_file>" in json.dumps(history)
        assert len(policy.requests) == 2 * GROUP_SIZE


def test_cline_against_the_tiny_model_reaches_the_trainer(tmp_path, swe_bench_row, cline_image, coding_run_id,
                                                          long_context_vllm):
    """The real tiny policy on vLLM: Cline's calls, recorded by the worker's proxy, are what the
    trainer trains on, masks and logprobs included (the logprob alarm stays on: the trainer's
    fp32 logprobs must agree with vLLM's). Nonsense scores 0."""
    with cline_run(tmp_path, swe_bench_row, cline_image, coding_run_id, long_context_vllm,
                   CONVEYOR_ROLLOUT__MAX_TOKENS_PER_TURN="16", CONVEYOR_ROLLOUT__MAX_TURNS="4") as (stack, dataset):
        _, pairs = trained_trajectories(stack, coding_run_id, dataset, GROUP_SIZE, timeout_s=900)
        for sample, trajectory in pairs:
            metrics = trajectory.env_info["agent"]["metrics"]
            print(f"\n{sample.trajectory_id}: {len(trajectory.turns)} calls, {json.dumps(metrics)}")
            assert metrics["boot_ok"] and len(trajectory.turns) >= 1, trajectory.env_info["agent"]
            assert trajectory.env_reward == 0.0 and sample.reward == 0.0
