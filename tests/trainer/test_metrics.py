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


def test_non_finite_metrics_are_written_as_null_and_the_file_stays_strict_json(tmp_path):
    import json
    import math

    import pytest

    path = tmp_path / "train_steps.jsonl"
    sink = MetricsSink(path)
    sink.log(1, {"reward_mean": 0.5, "loss": math.nan, "grad_norm": math.inf, "kl": -math.inf})
    sink.log(2, {"reward_mean": math.nan, "loss": 0.25})

    def refuse(constant: str):
        raise AssertionError(f"{constant} in {path}")

    lines = [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]
    assert [(s["loss"], s["grad_norm"], s["kl"]) for s in lines[:1]] == [(None, None, None)]
    assert (lines[0]["reward_mean"], lines[1]["reward_mean"], lines[1]["loss"]) == (0.5, None, 0.25)
    assert plot_reward_curve(path, tmp_path / "curve.png").exists()  # a null reward is a gap, not a crash
    with pytest.raises(ValueError, match="JSON compliant"):  # what JSON cannot hold fails loudly
        sink.log(3, {"per_layer": [math.nan]})
