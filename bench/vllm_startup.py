"""vLLM's start-up and decode speed on this host, compiled (vLLM's default) against eager
(``--enforce-eager``), on the tiny generated model: the lever behind ``inference.eager``.

Prints, per mode, the seconds from launch to serving and the completion tokens per second of
a fixed batch of requests, then eager's ratios to compiled, measured in this one run.

    .venv/bin/python bench/vllm_startup.py [--rounds 1] [--requests 32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.inference.server import VllmServer  # noqa: E402
from services.inference.tiny_model import generate_tiny_model  # noqa: E402
from services.cli.local_stack import free_port  # noqa: E402


def decode_rate(base_url: str, requests: int, max_tokens: int) -> float:
    """Completion tokens per second of ``requests`` concurrent completions."""
    def one(i: int) -> int:
        body = {"model": "tiny", "prompt": f"count {i}:", "max_tokens": max_tokens, "min_tokens": max_tokens,
                "temperature": 1.0, "seed": i}
        reply = httpx.post(f"{base_url}/v1/completions", json=body, timeout=300).json()
        return int(reply["usage"]["completion_tokens"])

    one(0)  # warm
    t0 = time.monotonic()
    with ThreadPoolExecutor(requests) as pool:
        tokens = sum(pool.map(one, range(requests)))
    return tokens / (time.monotonic() - t0)


def measure(model_dir: Path, eager: bool, root: Path, requests: int, max_tokens: int) -> tuple[float, float]:
    server = VllmServer(model_dir, "tiny", port=free_port(), log_path=root / f"vllm-{'eager' if eager else 'compiled'}.log",
                        max_model_len=512, eager=eager, startup_timeout=900)
    t0 = time.monotonic()
    with server:
        ready_s = time.monotonic() - t0
        rate = decode_rate(server.base_url, requests, max_tokens)
    return ready_s, rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="vllm-startup-"))
    model_dir = generate_tiny_model(root / "tiny")
    results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for round_ in range(args.rounds):
        for eager in (False, True):
            ready_s, rate = measure(model_dir, eager, root, args.requests, args.max_tokens)
            results[eager].append((ready_s, rate))
            print(f"round {round_ + 1} {'eager   ' if eager else 'compiled'}: ready in {ready_s:6.1f} s, "
                  f"decode {rate:8.1f} tokens/s ({args.requests} requests x {args.max_tokens} tokens)", flush=True)
    mean = {mode: (sum(r for r, _ in runs) / len(runs), sum(t for _, t in runs) / len(runs)) for mode, runs in results.items()}
    print(f"eager / compiled: start-up time {mean[True][0] / mean[False][0]:.2f}x, decode rate {mean[True][1] / mean[False][1]:.2f}x")


if __name__ == "__main__":
    main()
