"""What bench/in_flight.py samples while episodes run: the workers' Prometheus histograms (lease
renewal, event-loop lag), their resident memory, and Redis' operations and CPU.

A histogram's quantile is read from the difference of two scrapes (the level's start and end), as
the upper bound of the bucket it falls in: "p99 <= 25 ms", never interpolated.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from bench.local_runs import redis_cpu_s

RENEWAL = "conveyor_lease_renewal_seconds"
LAG = "conveyor_event_loop_lag_seconds"


def scrape(port: int) -> dict[str, dict[float, float]]:
    """Cumulative bucket counts of the renewal and lag histograms of one worker ({} if it is gone)."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return {}
    out: dict[str, dict[float, float]] = {RENEWAL: {}, LAG: {}}
    for family in text_string_to_metric_families(text):
        if family.name not in out:
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket") and sample.labels.get("stage", "rollout") == "rollout":
                bound = float(sample.labels["le"])
                out[family.name][bound] = out[family.name].get(bound, 0.0) + sample.value
    return out


def add(into: dict[str, dict[float, float]], more: dict[str, dict[float, float]], sign: float = 1.0) -> None:
    for name, buckets in more.items():
        target = into.setdefault(name, {})
        for bound, count in buckets.items():
            target[bound] = target.get(bound, 0.0) + sign * count


def bucket_quantile(buckets: dict[float, float], q: float) -> float:
    """The upper bound of the bucket holding the q-quantile of cumulative ``buckets`` (NaN: none)."""
    ordered = sorted(buckets.items())
    total = ordered[-1][1] if ordered else 0.0
    if total <= 0:
        return float("nan")
    return next(bound for bound, count in ordered if count >= q * total)


@dataclass
class Histograms:
    """The renewal and lag histograms summed over worker ports, between ``start`` and ``stop``.
    Per port: one started since counts from 0; one gone by ``stop`` (killed) is left out."""

    ports: list[int]
    _start: dict[int, dict[str, dict[float, float]]] = field(default_factory=dict)
    _delta: dict[str, dict[float, float]] = field(default_factory=dict)

    def start(self) -> None:
        self._start = {port: scrape(port) for port in self.ports}

    def stop(self) -> None:
        self._delta = {}
        for port in self.ports:
            if now := scrape(port):
                add(self._delta, now)
                add(self._delta, self._start.get(port, {}), -1.0)

    def quantile(self, name: str, q: float) -> float:
        return bucket_quantile(self._delta.get(name, {}), q)

    def count(self, name: str) -> int:
        buckets = self._delta.get(name, {})
        return int(buckets.get(float("inf"), 0))


@dataclass
class RedisMeter:
    """Commands and CPU seconds of redis-server between ``start`` and ``rates``."""

    client: object
    _at: tuple[float, int, float] = (0.0, 0, 0.0)

    def _now(self, wall: float) -> tuple[float, int, float]:
        return wall, int(self.client.info("stats")["total_commands_processed"]), redis_cpu_s(self.client)  # type: ignore[attr-defined]

    def start(self, wall: float) -> None:
        self._at = self._now(wall)

    def rates(self, wall: float) -> tuple[float, float]:
        """(operations/s, CPU cores) since ``start``."""
        t1, ops1, cpu1 = self._now(wall)
        t0, ops0, cpu0 = self._at
        span = max(t1 - t0, 1e-9)
        return (ops1 - ops0) / span, (cpu1 - cpu0) / span
