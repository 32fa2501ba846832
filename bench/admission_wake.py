"""Intake's admission hop, polled against woken (issue 28, item 2: event-driven wake-ups).

A synchronous run's intake waits on the staleness bound after each step; the trainer raises its
step and the weight follower then advances the served version, and the wait ends. This measures
the time from the served version's advance to the group's admission, ``--rounds`` times each,
with intake's 0.2 s poll alone (``time.sleep``, as before) and with the wake-up
(``shared.state.admission_wake``), in one run against one real redis-server:

    .venv/bin/python bench/admission_wake.py --rounds 50
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import redis

from services.cli.local_stack import LocalStack
from services.intake.admission_wait import AdmissionWait
from shared.state.policy_version import PolicyVersion
from shared.state.staleness import StalenessBudget


def _admit_into(wait: AdmissionWait, admitted: list[float]) -> None:
    wait.admit()
    admitted.append(time.monotonic())


def admission_latencies(client: redis.Redis, run_id: str, rounds: int, woken: bool, poll_s: float) -> list[float]:
    budget = StalenessBudget(client, run_id, max_off_policy_steps=0, groups_per_step=1)
    served = PolicyVersion(client, run_id)
    wait = AdmissionWait(budget, client, log_every_s=600, poll_s=poll_s)
    if not woken:
        wait.wake.pause = time.sleep  # type: ignore[method-assign]  # the poll alone, as before wake-ups
    assert budget.try_admit()
    rng, latencies = random.Random(0), []
    for step in range(1, rounds + 1):
        admitted: list[float] = []
        thread = threading.Thread(target=_admit_into, args=(wait, admitted))
        thread.start()
        time.sleep(rng.uniform(0.05, 0.3))  # the step's training, at a random phase of the poll
        budget.advance_step(step)
        moved = time.monotonic()
        served.advance(step)
        thread.join()
        latencies.append(admitted[0] - moved)
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--poll-s", type=float, default=0.2, help="intake's poll interval (AdmissionWait.poll_s)")
    args = parser.parse_args()
    stack = LocalStack(Path(tempfile.mkdtemp(prefix="admission-wake-")))
    try:
        client = redis.Redis.from_url(stack.start_redis(), decode_responses=True)
        print(f"load average {os.getloadavg()[0]:.2f}; {args.rounds} rounds each; poll {args.poll_s} s")
        results = {mode: admission_latencies(client, f"wake-{mode}", args.rounds, mode == "woken", args.poll_s)
                   for mode in ("polled", "woken")}
        for mode, values in results.items():
            ms = sorted(v * 1000 for v in values)
            print(f"{mode:>7}: served version advanced -> group admitted: mean {statistics.mean(ms):.1f} ms, "
                  f"p50 {statistics.median(ms):.1f} ms, max {ms[-1]:.1f} ms")
        ratio = statistics.mean(results["polled"]) / statistics.mean(results["woken"])
        print(f"ratio polled/woken (mean): {ratio:.1f}x; load average {os.getloadavg()[0]:.2f}")
    finally:
        for process in stack.processes:
            process.stop()


if __name__ == "__main__":
    main()
