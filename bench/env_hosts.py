"""Synchronous environments off the event loop: N concurrent episodes of a gym-style game whose
reset and steps block (time.sleep), in host processes and in host threads, against the same
episodes with awaiting steps. Prints seconds per round and the ratios (one run; the machine is
noisy, so compare the ratios).

    .venv/bin/python bench/env_hosts.py [--episodes 8] [--block-s 0.2] [--steps 3] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.rollout_worker.environments.hosted import POOL  # noqa: E402
from shared.environments import AgentAction, Environment, EnvironmentRegistry, StepResult, VerifyResult  # noqa: E402


class BlockingGame:
    """The package under test: synchronous, blocking."""

    def __init__(self, block_s: float):
        self.block_s = block_s

    def reset(self, seed=None, options=None):
        time.sleep(self.block_s)
        return "go"

    def step(self, action):
        time.sleep(self.block_s)
        return "ok", 0.0, False, False, {}


class AwaitingGame(Environment):
    name = "awaiting"
    block_s = 0.2

    async def reset(self, task_data, seed):
        await asyncio.sleep(self.block_s)
        return [{"role": "user", "content": "go"}]

    async def step(self, action):
        await asyncio.sleep(self.block_s)
        return StepResult("ok", done=False)

    async def verify(self):
        return VerifyResult(0.0)


async def _episode(registry: EnvironmentRegistry, name: str, config: dict, steps: int, seed: int) -> None:
    env = registry.make(name, config)
    try:
        await env.reset({}, seed)
        for _ in range(steps):
            await env.step(AgentAction("a", [], None))
        await env.verify()
    finally:
        await env.close()


def _round(registry, name, config, episodes, steps) -> float:
    async def run():
        await asyncio.gather(*(_episode(registry, name, config, steps, seed) for seed in range(episodes)))
    started = time.perf_counter()
    asyncio.run(run())
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--block-s", type=float, default=0.2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    AwaitingGame.block_s = args.block_s
    registry = EnvironmentRegistry({"awaiting": f"{__name__}:AwaitingGame"}, entry_points=False)
    module = Path(__file__).stem
    blocking = {"factory": f"{module}:BlockingGame", "kwargs": {"block_s": args.block_s}}
    cold = _round(registry, "gym", {**blocking, "isolation": "process"}, args.episodes, args.steps)
    rows = {"awaiting step": [], "blocking step, host process": [], "blocking step, host thread": []}
    for _ in range(args.rounds):  # interleaved, so drift hits every variant alike
        rows["awaiting step"].append(_round(registry, "awaiting", {}, args.episodes, args.steps))
        rows["blocking step, host process"].append(_round(registry, "gym", {**blocking, "isolation": "process"},
                                                          args.episodes, args.steps))
        rows["blocking step, host thread"].append(_round(registry, "gym", {**blocking, "isolation": "thread"},
                                                         args.episodes, args.steps))
    POOL.shutdown()
    ideal = (args.steps + 1) * args.block_s
    base = statistics.median(rows["awaiting step"])
    print(f"{args.episodes} concurrent episodes, reset + {args.steps} steps blocking {args.block_s}s each "
          f"(ideal {ideal:.2f}s), median of {args.rounds} rounds")
    print(f"  first round with host processes starting cold: {cold:.2f}s")
    for name, values in rows.items():
        median = statistics.median(values)
        print(f"  {name:<30} {median:.3f}s  (min {min(values):.3f}, max {max(values):.3f})  ratio {median / base:.2f}x")


if __name__ == "__main__":
    main()
