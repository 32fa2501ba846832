"""Per-step metrics reach every sink: the JSONL file, the Prometheus endpoint, and the PNG curve."""

from __future__ import annotations

import httpx

from services.cli.local_stack import free_port
from services.trainer.metrics import MetricsSink, RewardCurve, plot_reward_curve, read_steps


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


class _Observed(RewardCurve):
    """Records how many steps each drawing held (the real drawing still runs)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.drawn: list[int] = []

    def _draw(self):
        self.drawn.append(len(read_steps(self.jsonl_path)))
        return super()._draw()


def test_the_reward_curve_is_drawn_behind_the_step_and_holds_every_step_once_closed(tmp_path):
    sink = MetricsSink(tmp_path / "steps.jsonl")
    curve = _Observed("behind", sink.jsonl_path, tmp_path / "curve.png", "t")
    for step in range(1, 6):  # faster than a drawing: the steps that end during one are drawn by a later one
        sink.log(step, {"reward_mean": step / 10, "reward_std": 0.1})
        curve.step_ended()
    curve.close()
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert curve.drawn[-1] == 5 and len(curve.drawn) < 5  # whole once closed; skipped to the newest meanwhile


def test_a_reward_curve_that_cannot_be_drawn_is_logged_and_training_goes_on(tmp_path, caplog):
    sink = MetricsSink(tmp_path / "steps.jsonl")
    (tmp_path / "taken").write_text("a file where the curve's folder should be")
    curve = RewardCurve("behind", sink.jsonl_path, tmp_path / "taken" / "curve.png", "t")
    sink.log(1, {"reward_mean": 0.5, "reward_std": 0.0})
    curve.step_ended()
    curve.close()
    assert "reward curve" in caplog.text and "not drawn" in caplog.text
    off = RewardCurve("off", sink.jsonl_path, tmp_path / "off.png", "t")
    off.step_ended()
    off.close()
    assert not (tmp_path / "off.png").exists()
