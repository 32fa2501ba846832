"""The rollout worker's HTTP client to inference: CPU per request, httpx against aiohttp (issue 15).

A worker process runs hundreds of episodes on one core, every turn one request to vLLM. So the
client's own CPU per request bounds the process's trajectories/s once the policy is fast.

Method. A replay server (aiohttp, in its own process) answers ``/v1/completions`` at once with
two token ids. The client sends ``--requests`` requests, ``--concurrency`` at a time, each with
a 100-token prompt (ids, as the worker sends them), and parses the JSON answer. The figure is
the client process's CPU time (``time.process_time``) per request; wall requests/s is printed
too. The two clients alternate ``--rounds`` times in one run and the ratio is taken of the
means. httpx is configured as the worker's client was (512 connections, 128 kept alive);
aiohttp as ``services.rollout_worker.inference_client`` is (one session, 512 connections).

    .venv/bin/python bench/inference_client.py [--requests 4000] [--concurrency 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402
import httpx  # noqa: E402
from aiohttp import web  # noqa: E402

from services.cli.local_stack import free_port  # noqa: E402

PROMPT = list(range(100))


def serve(port: int) -> None:
    async def completions(request: web.Request) -> web.Response:
        await request.json()
        return web.json_response({"choices": [{"token_ids": [1, 2], "logprobs": {"token_logprobs": [-0.1, -0.1]},
                                               "finish_reason": "stop"}]})

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions)])
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


async def with_httpx(url: str, requests: int, concurrency: int) -> None:
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=128)
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with gate:
                (await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})).json()

        await asyncio.gather(*(one() for _ in range(requests)))


async def with_aiohttp(url: str, requests: int, concurrency: int) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=512)) as session:
        gate = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with gate:
                async with session.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}) as response:
                    await response.json()

        await asyncio.gather(*(one() for _ in range(requests)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(target=serve, args=(port,), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.post(url + "/v1/completions", json={"prompt": [1]}, timeout=1)
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise SystemExit("the replay server did not start") from None
            time.sleep(0.2)
    cpu_ms: dict[str, list[float]] = {"httpx": [], "aiohttp": []}
    try:
        for _ in range(args.rounds):
            for name, client in (("httpx", with_httpx), ("aiohttp", with_aiohttp)):
                cpu0, wall0 = time.process_time(), time.perf_counter()
                asyncio.run(client(url, args.requests, args.concurrency))
                cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
                cpu_ms[name].append(1000 * cpu / args.requests)
                print(f"{name:8s} CPU {1000 * cpu / args.requests:.3f} ms/request, {args.requests / wall:,.0f} requests/s wall",
                      flush=True)
    finally:
        server.terminate()
    httpx_ms, aiohttp_ms = statistics.fmean(cpu_ms["httpx"]), statistics.fmean(cpu_ms["aiohttp"])
    print(f"mean CPU per request at concurrency {args.concurrency}: httpx {httpx_ms:.3f} ms, aiohttp {aiohttp_ms:.3f} ms; "
          f"httpx / aiohttp = {httpx_ms / aiohttp_ms:.1f}x")


if __name__ == "__main__":
    main()
