"""What the lost-run guard costs a write (``shared.state.run_marker``), in one run against one real
redis-server.

Every write of a run's records is refused once Redis lost the run. A Lua script takes the run's
marker as one more KEY (``RunMarker.run_script``): no more round trips than before. A plain
command goes through ``RunMarker.guarded``, one transaction that watches the marker (WATCH,
EXISTS, MULTI/EXEC: three round trips where there was one). This times both kinds, guarded and
bare, interleaved round by round so that the machine's noise falls on both alike, and prints
their ratios:

    .venv/bin/python bench/lost_run_guard.py --writes 2000
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import redis

from services.cli.local_stack import LocalStack
from shared.state.run_marker import TRAINER_STOPS, RunMarker
from shared.state.staleness import StalenessBudget
from shared.state.step_metrics import StepMetrics


def per_write_us(write: Callable[[int], object], writes: int) -> float:
    t0 = time.perf_counter()
    for i in range(writes):
        write(i)
    return (time.perf_counter() - t0) / writes * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--writes", type=int, default=2000, help="writes per arm and round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with LocalStack(Path(tempfile.mkdtemp(prefix="lost-run-guard-"))) as stack:  # stops its redis-server on the way out
        client = redis.Redis.from_url(stack.start_redis(), decode_responses=True)
        run_id = "guard"
        marker = RunMarker(client, run_id)
        marker.open()
        budget, steps = StalenessBudget(client, run_id, 0, 1), StepMetrics(client, run_id)
        line = {"step": 1, "loss": 0.5, "reward_mean": 0.25}
        step = itertools.count(1)  # every advance raises the step: a write each time, in both arms
        arms: dict[str, Callable[[int], object]] = {
            "script, bare": lambda i: budget.advance_step(next(step)),
            "script, guarded": lambda i: budget.advance_step(next(step), marker),
            "command, bare": lambda i: steps.append(line),
            "command, guarded": lambda i: marker.guarded(lambda tx: steps.append(line, transaction=tx), TRAINER_STOPS),
        }
        print(f"load average {os.getloadavg()[0]:.2f}; {args.rounds} rounds of {args.writes} writes per arm")
        times: dict[str, list[float]] = {name: [] for name in arms}
        for _ in range(args.rounds):
            for name, write in arms.items():
                times[name].append(per_write_us(write, args.writes))
        for name, values in times.items():
            print(f"{name:>17}: median {statistics.median(values):7.1f} us per write (rounds: "
                  f"{', '.join(f'{v:.0f}' for v in values)})")
        for kind in ("script", "command"):
            ratio = statistics.median(times[f"{kind}, guarded"]) / statistics.median(times[f"{kind}, bare"])
            print(f"{kind}: guarded / bare = {ratio:.2f}")
        print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
