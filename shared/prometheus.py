"""Prometheus metrics that every long-running Conveyor service exposes (``metrics_port``).

- Rollout workers: episodes in flight, sandbox provisioning time, inference request latency,
  the lag of their event loop (``rollout_worker.event_loop``).
- Any lease holder: the time of one heartbeat's renewal of all its leases (``shared.state.leases``).
- Scoring workers: scoring time per trajectory.
- The inference control plane: weight-sync time and the served policy version.
- Any service given a Redis client: queue depth of ``rollouts`` and ``scoring``, and the
  ledger's trajectories per run and state. These are read from Redis when Prometheus scrapes
  (``LedgerCollector``), so they are never stale and cost nothing between scrapes.
- The trainer's step metrics (``services.trainer.metrics``), vLLM's own ``/metrics`` on its
  API port, and Flower's ``/metrics`` complete the picture.

Invariants: names start with ``conveyor_``; ``serve_metrics`` starts at most one endpoint per
process and a port that cannot be bound is logged, never fatal.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from shared.names import ROLLOUT_QUEUE, SCORING_QUEUE

log = logging.getLogger(__name__)

EPISODES_IN_FLIGHT = Gauge("conveyor_rollout_episodes_in_flight", "episodes running in this worker process")
SANDBOX_PROVISION_SECONDS = Histogram(
    "conveyor_sandbox_provision_seconds", "time to provision a sandbox container",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60))
INFERENCE_REQUEST_SECONDS = Histogram(
    "conveyor_inference_request_seconds", "latency of one completion request to the inference service",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120))
WEIGHT_SYNC_SECONDS = Histogram("conveyor_weight_sync_seconds", "download and in-place sync of one policy version",
                                buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120, 600))
SERVED_POLICY_VERSION = Gauge("conveyor_served_policy_version", "the policy version the replicas serve")
CODING_VERDICTS = Counter(
    "conveyor_coding_verdicts_total", "coding episodes graded by hidden tests, by verdict: "
    "flagged (the static diff scan scored it 0), untrusted (the test report was not trusted), graded", ["verdict"])
LEASE_RENEWAL_SECONDS = Histogram(
    "conveyor_lease_renewal_seconds", "one heartbeat's renewal of every lease a process holds for a stage",
    ["stage"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
EVENT_LOOP_LAG_SECONDS = Histogram(
    "conveyor_event_loop_lag_seconds", "how late the rollout worker's event loop ran a timer it had scheduled",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
SCORING_SECONDS = Histogram("conveyor_scoring_seconds", "time to score one trajectory",
                            buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30))

_started: set[int] = set()
_lock = threading.Lock()


class LedgerCollector(Collector):
    """Queue depth and ledger states, read from Redis at scrape time: the queues from the
    broker's Redis (``broker_client``, when it is not the ledger's: ``redis.broker_url``)."""

    def __init__(self, redis_client: Any, broker_client: Any = None):
        self.redis = redis_client
        self.broker = redis_client if broker_client is None else broker_client

    def collect(self):
        from shared.state.ledger import STATES, Ledger

        depth = GaugeMetricFamily("conveyor_queue_depth", "messages waiting in a Celery queue", labels=["queue"])
        states = GaugeMetricFamily("conveyor_ledger_trajectories", "trajectories per run and ledger state",
                                   labels=["run", "state"])
        try:
            for queue in (ROLLOUT_QUEUE, SCORING_QUEUE):
                depth.add_metric([queue], float(self.broker.llen(queue)))
            ledger = Ledger(self.redis)
            for run in ledger.runs():
                counts = ledger.counts(run)
                for state in STATES:
                    states.add_metric([run, state], float(counts[state]))
        except Exception as exc:  # a scrape during a Redis outage reports what it has
            log.warning("metrics: cannot read Redis: %s", exc)
        yield depth
        yield states


def serve_metrics(port: int | None, redis_client: Any = None, broker_client: Any = None) -> bool:
    """Expose this process's metrics on ``port`` (None: off); True if the endpoint is up."""
    if not port:
        return False
    with _lock:
        if port in _started:
            return True
        try:
            start_http_server(port)
        except OSError as exc:
            log.error("Prometheus endpoint on port %s disabled: %s", port, exc)
            return False
        _started.add(port)
        if redis_client is not None:
            REGISTRY.register(LedgerCollector(redis_client, broker_client))
    log.info("Prometheus metrics on :%d/metrics", port)
    return True
