"""The rollout worker's inference client through an outage, against a small real HTTP server
that stops and starts again on its port (vLLM itself goes through the same in
``tests/chaos/test_inference_outage.py``): requests wait instead of failing and get their
answer once the server is back, the wait does not count against their time budget, the worker
is told once when the outage starts and once when it ends, and answers that are the request's
fault are not retried."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from services.cli.local_stack import free_port
from services.rollout_worker.inference_client import InferenceClient, InferenceRejected, InferenceUnavailable
from shared.settings import OutageSettings

COMPLETION = {"choices": [{"token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.5, -0.25]}, "finish_reason": "stop"}]}


class _Server(ThreadingHTTPServer):
    request_queue_size = 64  # ten connections at once must not wait for a SYN retry


class FakeVllm:
    """/health and /v1/completions; ``completion_status`` chooses the completion's answer."""

    def __init__(self, port: int):
        self.port, self.completion_status, self.completions = port, 200, 0
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> None:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # noqa: ANN002
                pass

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                self._answer(200, {})

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                fake.completions += 1
                self._answer(fake.completion_status, COMPLETION if fake.completion_status == 200 else {"error": "x"})

        self._server = _Server(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def server():
    fake = FakeVllm(free_port())
    fake.start()
    yield fake
    fake.stop()


OUTAGE = OutageSettings(limit_s=60, backoff_max_s=0.2, log_every_s=1)


def test_requests_wait_out_an_outage_and_get_their_answer_when_the_server_is_back(server):
    changes: list[bool] = []

    async def go():
        async with InferenceClient(f"http://127.0.0.1:{server.port}", "tiny", timeout_s=5, outage=OUTAGE,
                                   on_outage_change=changes.append) as client:
            assert (await client.complete([1, 2], 4, seed=1)).token_ids == [5, 6]
            server.stop()  # down for 2 s
            threading.Timer(2.0, server.start).start()
            started = time.monotonic()
            # 10 requests with 1 s of time budget each, all sent during the outage
            results = await asyncio.gather(*(client.complete([1, 2], 4, seed=s, budget_s=1.0) for s in range(10)))
            return results, time.monotonic() - started

    results, waited = asyncio.run(go())
    assert waited >= 1.9
    assert [r.token_ids for r in results] == [[5, 6]] * 10  # none failed: the wait is not their time
    assert all(r.outage_wait_s >= 1.5 for r in results)
    assert changes == [False, True]  # one outage, told once each way


def test_a_5xx_while_the_server_is_healthy_is_retried_then_raised(server):
    server.completion_status = 500

    async def go():
        async with InferenceClient(f"http://127.0.0.1:{server.port}", "tiny", timeout_s=5, max_retries=2, outage=OUTAGE) as client:
            await client.complete([1], 4, seed=1)

    with pytest.raises(InferenceUnavailable, match="failed the request 3 times: HTTP 500"):
        asyncio.run(go())
    assert server.completions == 3


def test_a_4xx_is_the_requests_fault_and_is_not_retried(server):
    server.completion_status = 400

    async def go():
        async with InferenceClient(f"http://127.0.0.1:{server.port}", "tiny", timeout_s=5, outage=OUTAGE) as client:
            await client.complete([1], 4, seed=1)

    with pytest.raises(InferenceRejected, match="HTTP 400"):
        asyncio.run(go())
    assert server.completions == 1
