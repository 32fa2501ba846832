"""Per-step metrics reach every sink: the JSONL file, the Prometheus endpoint, and the PNG curve."""

from __future__ import annotations

import httpx

from services.cli.local_stack import free_port
from services.trainer.metrics import MetricsSink, plot_reward_curve, read_steps


def test_step_metrics_go_to_jsonl_and_prometheus_and_the_curve(tmp_path):
    port = free_port()
    sink = MetricsSink(tmp_path / "steps.jsonl", prometheus_port=port)
    sink.log(1, {"reward_mean": 0.25, "reward_std": 0.1, "weight_sync_s": 0.12})
    sink.log(2, {"reward_mean": 0.5, "reward_std": 0.2, "weight_sync_s": 0.10})
    steps = read_steps(tmp_path / "steps.jsonl")
    assert [(s["step"], s["reward_mean"]) for s in steps] == [(1, 0.25), (2, 0.5)]
    exposed = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    assert "conveyor_trainer_reward_mean 0.5" in exposed and "conveyor_trainer_weight_sync_s 0.1" in exposed
    png = plot_reward_curve(tmp_path / "steps.jsonl", tmp_path / "curve.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
