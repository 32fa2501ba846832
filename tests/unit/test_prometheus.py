"""The Prometheus endpoint every long-running service can expose (shared.prometheus), scraped
over HTTP, with queue depth and ledger states read from a real Redis at scrape time."""

from __future__ import annotations

import httpx

from services.cli.local_stack import free_port
from shared.state.ledger import Ledger
from shared.names import ROLLOUT_QUEUE
from shared.prometheus import EPISODES_IN_FLIGHT, INFERENCE_REQUEST_SECONDS, LedgerCollector, serve_metrics
from shared.redis_clients import redis_for
from test_ledger import requests_for


def test_the_endpoint_serves_worker_metrics_queue_depth_and_ledger_states(redis_client, run_id) -> None:
    Ledger(redis_client).register(requests_for(run_id, size=3))
    redis_client.delete(ROLLOUT_QUEUE)
    redis_client.rpush(ROLLOUT_QUEUE, "a", "b")
    EPISODES_IN_FLIGHT.inc(2)
    INFERENCE_REQUEST_SECONDS.observe(0.2)
    port = free_port()
    assert serve_metrics(port, redis_client) and serve_metrics(port, redis_client)  # once per process
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        EPISODES_IN_FLIGHT.dec(2)
        redis_client.delete(ROLLOUT_QUEUE)
    assert 'conveyor_queue_depth{queue="rollouts"} 2.0' in text
    assert f'conveyor_ledger_trajectories{{run="{run_id}",state="queued"}} 3.0' in text
    assert "conveyor_rollout_episodes_in_flight 2.0" in text
    assert "conveyor_inference_request_seconds_count" in text
    assert not serve_metrics(None)


def test_a_ledger_on_a_cluster_reads_queue_depth_from_the_brokers_own_redis(redis_cluster_url, redis_url, run_id) -> None:
    ledger_client, broker = redis_for(redis_cluster_url), redis_for(redis_url)
    Ledger(ledger_client).register(requests_for(run_id, size=2))
    broker.delete(ROLLOUT_QUEUE)
    broker.rpush(ROLLOUT_QUEUE, "a", "b", "c")
    try:
        depth, states = LedgerCollector(ledger_client, broker).collect()
    finally:
        broker.delete(ROLLOUT_QUEUE)
    assert {s.labels["queue"]: s.value for s in depth.samples}[ROLLOUT_QUEUE] == 3.0
    assert {(s.labels["run"], s.labels["state"]): s.value for s in states.samples}[(run_id, "queued")] == 2.0
