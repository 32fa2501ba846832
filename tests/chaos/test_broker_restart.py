"""Chaos: Redis, which is also the Celery broker, restarts in the middle of a run while most
groups still wait in the rollout queue (redis-server with its append-only file, the filesystem
object store, Celery rollout and scoring workers, the trainer and intake, all real processes;
inference is a scripted stand-in for vLLM: no tokens are needed to count deliveries).

What a user relies on (issue 24: a broker restart delivered 4.7 times more rollout tasks than
groups, all no-ops, and the scorer printed a Celery Gossip traceback):
- the restart multiplies no task: rollout deliveries stay within one per group plus one per
  task that was running when Redis went down (the workers' slots); the messages that only
  waited in the queue through the outage are not copied, though every dispatch deadline passed;
- nothing is lost or doubled: every trajectory is consumed, reaches the trainer once and sits
  in one group record (``ChaosRun`` checks it);
- no worker prints a traceback for the restart.
"""

from __future__ import annotations

import re
import threading
from collections import Counter

import pytest
from scripted_completions import ScriptedCompletions

from services.cli.chaos import ChaosConfig, ChaosRun
from services.cli.local_stack import LocalStack
from services.inference.tiny_model import generate_tiny_model
from shared.names import ROLLOUT_TASK

pytestmark = pytest.mark.slow

RECEIVED = re.compile(re.escape(ROLLOUT_TASK) + r"\[([0-9a-f-]+)\] received")


def test_a_broker_restart_mid_run_copies_no_waiting_task_and_loses_or_doubles_nothing(tmp_path):
    model = generate_tiny_model(tmp_path / "tiny")
    scripted = ScriptedCompletions(model, "tiny", ["<guess>50</guess>", "<guess>25</guess>", "<guess>75</guess>"])
    threading.Thread(target=scripted.server.serve_forever, daemon=True).start()
    # two groups run at a time, so most wait in the queue when Redis stops; down 5 s plus the
    # reapers' settling, which outlasts the 6 s dispatch deadline of everything that waits
    config = ChaosConfig(groups=10, group_size=4, seed=1, faults=["redis_restart"], fault_s=5.0, gap_s=(0.5, 1.0),
                         span=(0.2, 0.3), step_latency_s=0.4, concurrency=2, dispatch_ttl_s=6.0)
    stack = LocalStack(tmp_path / "stack", run_id="brokerrestart")
    chaos = ChaosRun(stack, config, lambda s: s.use_inference(scripted.base_url, model, "tiny"))
    try:
        report = chaos.run()
    finally:
        stack.stop()
        scripted.server.shutdown()
    logs = {name: (tmp_path / "stack" / "logs" / f"{name}.log").read_text() for name in ("worker-rollout", "worker-scoring")}
    assert report.ok and len(report.records) == 1, report.table() + "\n" + logs["worker-rollout"][-3000:]
    deliveries = Counter(RECEIVED.findall(logs["worker-rollout"]))
    print(f"\n{report.table()}\nrollout deliveries: {sum(deliveries.values())} for {config.groups} groups "
          f"({len(deliveries)} distinct tasks)")
    assert sum(deliveries.values()) <= config.groups + config.concurrency, deliveries
    assert report.rerun == {"rollout": 0, "scoring": 0}  # the outage made no work run twice
    for name, log in logs.items():
        assert "Traceback" not in log and "Gossip" not in log, f"{name}:\n{log[-3000:]}"
