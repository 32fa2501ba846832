"""Atropos 0.4's API server fed the trajectories of Conveyor's capacity benchmark (issue 15, item 2).

atroposlib is never installed into Conveyor's venv: ``bench/atropos_venv.sh`` makes
``.bench/atropos-venv`` with ``atroposlib==0.4.0``, and this module starts the API server from
there (``run-api``, its entry point, as shipped: uvicorn, access log on) and talks to it over HTTP.

What it feeds the server: scored groups of the given trajectories, one group per request to
``/scored_data`` (tokens, masks with -100 on prompt positions, scores, inference logprobs), as an
Atropos environment sends each group once its rollouts are scored (``BaseEnv.handle_send_to_api``:
JSON, gzip from 1 KB). No LLM and no environment run: ``producers`` processes, each registered
with ``/register-env``, stand in for the environments and push their share of the groups at once,
``concurrency`` requests in flight each. One trainer-like consumer registers with ``/register``
(a batch of ``batch_groups`` groups; 1 matches Conveyor's one training batch per group) and polls
``/batch`` (every ``poll_s`` when it comes back empty) until every sequence is delivered.

It reports:
- end-to-end trajectories/s, first push to last sequence delivered by ``/batch``;
- intake trajectories/s, first push to last push acknowledged;
- trainer-side latency p50/p99 per group, push to delivery (the push time travels in the
  group's ``group_overrides``, which the server hands back untouched);
- the API server's resident memory (peak), the bytes posted and the tokens per trajectory.

What Atropos guarantees here: the queue is a Python list in the server's memory. A restart of
the server loses every group pushed and not yet delivered, and a group is delivered once because
``/batch`` pops it, with no acknowledgement from the trainer.

    bench/atropos_venv.sh
    .venv/bin/python bench/atropos_side_by_side.py [--trajectories 1024] [--group-sizes 4 16]
        [--producers 1] [--prompt-tokens 14 --completion-tokens 3]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import multiprocessing
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.local_runs import pct, rss_mb  # noqa: E402
from services.cli.local_stack import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PYTHON = ROOT / ".bench" / "atropos-venv" / "bin" / "python"
GUARANTEES = ("Atropos: in-memory queue in one server process, a group delivered once by being popped, "
              "lost on a restart. Conveyor: every trajectory in the durable ledger and in S3, exactly once "
              "to the trainer across crashes.")


@dataclass(frozen=True)
class ScoredGroup:
    """One group as an Atropos environment posts it to ``/scored_data``."""

    tokens: list[list[int]]
    masks: list[list[int]]  # the token id where trained, -100 elsewhere
    scores: list[float]
    inference_logprobs: list[list[float]]


def synthetic_groups(trajectories: int, group_size: int, prompt_tokens: int, completion_tokens: int) -> list[ScoredGroup]:
    """Groups of the given token lengths, for a run without Conveyor's trajectories at hand."""
    length = prompt_tokens + completion_tokens
    tokens = [(7 * i) % 1000 for i in range(length)]
    masks = [-100] * prompt_tokens + tokens[prompt_tokens:]
    logprobs = [0.0] * prompt_tokens + [-0.1] * completion_tokens
    return [ScoredGroup([tokens] * group_size, [masks] * group_size, [float(i % 2) for i in range(group_size)],
                        [logprobs] * group_size) for _ in range(max(1, trajectories // group_size))]


class AtroposServer:
    """``run-api`` of the Atropos venv on a free local port; stopped (and waited for) on exit."""

    def __init__(self, python: Path, log_path: Path) -> None:
        if not python.exists():
            raise SystemExit(f"{python} not found: make the Atropos venv first (bench/atropos_venv.sh)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen([str(python.parent / "run-api"), "--host", "127.0.0.1", "--port", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def __enter__(self) -> "AtroposServer":
        deadline = time.time() + 60
        while True:
            try:
                httpx.get(self.url + "/", timeout=1).raise_for_status()
                return self
            except httpx.HTTPError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"Atropos API server did not start; see {self._log.name}") from None
                time.sleep(0.2)

    def __exit__(self, *_: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def _body(group: ScoredGroup, env_id: int) -> tuple[bytes, dict[str, str]]:
    """What ``BaseEnv._post_json_with_compression`` sends, with the push time in ``group_overrides``."""
    payload = asdict(group) | {"env_id": env_id, "group_overrides": {"pushed_at": time.time()}}
    body = json.dumps(payload).encode()
    if len(body) >= 1024 and len(zipped := gzip.compress(body)) < len(body):
        return zipped, {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    return body, {"Content-Type": "application/json"}


async def _push(url: str, group_size: int, groups: list[ScoredGroup], concurrency: int, ready, go) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/register-env", json={"max_token_length": 4096, "desired_name": "capacity",
                                                            "weight": 1.0, "group_size": group_size}) as resp:
            env_id = (await resp.json())["env_id"]
        ready.put("ready")
        await asyncio.get_running_loop().run_in_executor(None, go.wait)
        first_push = time.time()
        sent = errors = 0
        pending = iter(groups)

        async def sender() -> None:
            nonlocal sent, errors
            for group in pending:
                body, headers = _body(group, env_id)
                async with session.post(f"{url}/scored_data", data=body, headers=headers) as resp:
                    await resp.read()
                    errors += resp.status != 200
                sent += len(body)

        await asyncio.gather(*(sender() for _ in range(concurrency)))
        return {"first_push": first_push, "last_ack": time.time(), "bytes": sent, "errors": errors}


def _producer(url: str, group_size: int, groups: list[ScoredGroup], concurrency: int, ready, go, results) -> None:
    results.put(asyncio.run(_push(url, group_size, groups, concurrency, ready, go)))


def run_atropos(groups: list[ScoredGroup], producers: int, concurrency: int = 16, batch_groups: int = 1,
                poll_s: float = 0.02, python: Path = DEFAULT_PYTHON, log_dir: Path = Path("/tmp"),
                timeout_s: float = 1800) -> dict:
    """Push ``groups`` through a fresh Atropos API server and pull them back through ``/batch``."""
    group_size = len(groups[0].tokens)
    total = sum(len(g.tokens) for g in groups)
    ctx = multiprocessing.get_context("spawn")  # the caller may hold threads; producers import only this module
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    with AtroposServer(python, log_dir / f"atropos-api-g{group_size}-p{producers}.log") as server, \
            httpx.Client(base_url=server.url, timeout=30) as trainer:
        trainer.post("/register", json={"wandb_group": "", "wandb_project": "", "batch_size": batch_groups * group_size,
                                        "max_token_len": 4096, "checkpoint_dir": str(log_dir), "save_checkpoint_interval": 0,
                                        "starting_step": 0, "num_steps": 1}).raise_for_status()
        trainer.get("/batch").raise_for_status()  # the first /batch starts the run: environments may register
        procs = [ctx.Process(target=_producer, args=(server.url, group_size, groups[i::producers], concurrency, ready, go, results),
                             daemon=True) for i in range(producers)]
        for p in procs:
            p.start()
        for _ in procs:
            ready.get(timeout=120)
        go.set()
        delivered, latencies, rss = 0, [], []
        deadline = time.time() + timeout_s
        while delivered < total:
            batch = trainer.get("/batch").json()["batch"]
            now = time.time()
            rss.append(rss_mb(server.proc.pid))
            if batch is None:
                if now > deadline:
                    raise TimeoutError(f"Atropos delivered {delivered} of {total} sequences in {timeout_s:.0f}s")
                time.sleep(poll_s)
                continue
            for group in batch:
                delivered += len(group["tokens"])
                latencies.append(now - group["group_overrides"]["pushed_at"])
        pushes = [results.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(10)
    first = min(p["first_push"] for p in pushes)
    return {
        "system": "atropos", "producers": producers, "group_size": group_size, "trajectories": total,
        "tokens_per_traj": sum(len(t) for g in groups for t in g.tokens) / total,
        "push_errors": sum(p["errors"] for p in pushes), "traj_per_s": total / (now - first),
        "intake_traj_per_s": total / (max(p["last_ack"] for p in pushes) - first),
        "latency_p50_ms": 1000 * pct(latencies, 0.5), "latency_p99_ms": 1000 * pct(latencies, 0.99),
        "server_rss_mb_peak": max(rss), "posted_bytes_per_traj": sum(p["bytes"] for p in pushes) / total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=1024)
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--producers", type=int, nargs="+", default=[1])
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight per producer")
    parser.add_argument("--batch-groups", type=int, default=1, help="groups per /batch")
    parser.add_argument("--prompt-tokens", type=int, default=14, help="as capacity.py's trajectories")
    parser.add_argument("--completion-tokens", type=int, default=3)
    parser.add_argument("--atropos-python", type=Path, default=DEFAULT_PYTHON)
    args = parser.parse_args()
    print(GUARANTEES)
    for producers in args.producers:
        for group_size in args.group_sizes:
            groups = synthetic_groups(args.trajectories, group_size, args.prompt_tokens, args.completion_tokens)
            result = run_atropos(groups, producers, args.concurrency, args.batch_groups, python=args.atropos_python)
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}), flush=True)


if __name__ == "__main__":
    main()
