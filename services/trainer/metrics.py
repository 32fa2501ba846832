"""Per-step training metrics: one JSONL line per step, Prometheus gauges, optional W&B, and
a reward-curve PNG.

Invariants:
- Every sink gets the same flat dict of numbers for a step; a sink that fails (W&B offline, a
  port in use) is reported once at start and turned off, never crashing training.
- The JSONL file is strict JSON: a non-finite number (a NaN loss, an infinite gradient norm)
  is written as ``null``, and a value JSON cannot hold raises instead of writing ``NaN``.
- A fault of the disk under the JSONL file is waited out (``shared.storage_faults``), and a
  line cut short by one never joins the next.
- The reward curve is drawn off the trainer's thread by default (``RewardCurve``): the thread
  that reads groups never waits for a PNG, and the PNG holds every step once the loop closed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from shared.storage_faults import wait_out_disk_faults

log = logging.getLogger(__name__)


class MetricsSink:
    def __init__(self, jsonl_path: Path, prometheus_port: int | None = None, wandb_project: str | None = None, run_id: str = ""):
        self.jsonl_path = Path(jsonl_path)
        self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
        self._gauges: dict[str, Any] = {}
        self._prometheus = False
        if prometheus_port:
            from shared.prometheus import serve_metrics

            self._prometheus = serve_metrics(prometheus_port)
        self._wandb = None
        if wandb_project:
            try:
                import wandb

                self._wandb = wandb.init(project=wandb_project, name=run_id, reinit=True)
            except Exception as exc:  # W&B is optional; training goes on without it
                log.error("W&B logging disabled: %s", exc)

    def logged(self, step: int) -> bool:
        """Whether ``step`` has a line in the metrics file already: a step replayed after a crash
        that came after its line was written."""
        return any(line.get("step") == step for line in read_steps(self.jsonl_path))

    def log(self, step: int, metrics: dict[str, float], jsonl_path: Path | None = None) -> None:
        """``jsonl_path``: another file for this line (eval passes), the other sinks alike."""
        line = json.dumps({"step": step, "time": time.time(), **{k: finite_or_none(v) for k, v in metrics.items()}}, allow_nan=False)
        path = Path(jsonl_path or self.jsonl_path)
        wait_out_disk_faults("trainer metrics file", lambda: _append_line(path, line))
        if self._prometheus:
            from prometheus_client import Gauge

            for name, value in metrics.items():
                gauge = self._gauges.get(name)
                if gauge is None:
                    gauge = self._gauges[name] = Gauge(f"conveyor_trainer_{name}", f"trainer metric {name}")
                gauge.set(value)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)


def metric_name(text: str) -> str:
    """``text`` as a part of a metric's name (Prometheus allows letters, digits and ``_``)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", text)


def finite_or_none(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def read_steps(jsonl_path: Path) -> list[dict[str, float]]:
    path = Path(jsonl_path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def plot_reward_curve(jsonl_path: Path, png_path: Path, title: str = "reward") -> Path:
    """Draw the mean reward per step of ``jsonl_path`` to ``png_path``. Matplotlib's object API,
    no pyplot: no global figure state, so a thread of its own may draw (``RewardCurve``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = read_steps(jsonl_path)
    xs = [s["step"] for s in steps]
    mean = [math.nan if s["reward_mean"] is None else s["reward_mean"] for s in steps]  # null: a gap in the curve
    std = [s.get("reward_std") or 0.0 for s in steps]
    fig = Figure(figsize=(6, 3.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(xs, mean, marker="o", label="mean reward")
    ax.fill_between(xs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2, label="± std")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path)
    return png_path


class RewardCurve:
    """The reward-curve PNG of a training run, redrawn after each step (``trainer.reward_curve``):

    - ``behind`` (the default): in a thread of its own, so the trainer goes back to reading groups
      at once. A synchronous step's rollouts start as soon as its weights are served; drawn in the
      trainer's thread (``in_step``, 0.06 s quiet, 0.3-0.6 s under load with the checkpoint writer
      beside it), the curve kept the next step's first groups unread (``docs/performance/loop_speed.md``).
      At most one drawing at a time; a step that ends while one is drawn is drawn by the next
      step's (skip to the newest), and ``close`` draws the last one: the PNG lags at most a step
      while training, and is whole once the loop closed. A drawing that fails is logged and the
      next step draws again: a PNG is not the run's data, training goes on.
    - ``in_step``: in the trainer's thread, before the step returns.
    - ``off``: never drawn."""

    def __init__(self, mode: str, jsonl_path: Path, png_path: Path, title: str):
        self.mode, self.jsonl_path, self.png_path, self.title = mode, jsonl_path, png_path, title
        self._drawer: ThreadPoolExecutor | None = None
        self._drawing: Future[Path] | None = None
        self._undrawn = False  # a step ended while a drawing was under way: it is not in the PNG

    def step_ended(self) -> None:
        if self.mode == "in_step":
            self._draw()
        elif self.mode == "behind":
            if self._drawing is not None and not self._drawing.done():
                self._undrawn = True
                return
            self._collect()
            if self._drawer is None:
                self._drawer = ThreadPoolExecutor(1, thread_name_prefix="reward-curve")
            self._undrawn = False
            self._drawing = self._drawer.submit(self._draw)

    def close(self) -> None:
        """Wait for the drawing under way; draw the steps it did not hold."""
        if self._drawing is not None:
            self._drawing.exception()  # waits
            self._collect()
        if self._undrawn:
            self._undrawn = False
            try:
                self._draw()
            except Exception as exc:  # the loop closes on: its last checkpoint comes after this
                log.error("reward curve %s not drawn: %s", self.png_path, exc)
        if self._drawer is not None:
            self._drawer.shutdown(wait=True)

    def _draw(self) -> Path:
        return plot_reward_curve(self.jsonl_path, self.png_path, self.title)

    def _collect(self) -> None:
        """Log the failure of the drawing that ended, if it failed."""
        drawing, self._drawing = self._drawing, None
        if drawing is not None and drawing.exception() is not None:
            log.error("reward curve %s not drawn: %s", self.png_path, drawing.exception())


def _append_line(path: Path, line: str) -> None:
    """One line, on a line of its own even after a write cut short by a fault of the disk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+b") as fh:
        end = fh.seek(0, os.SEEK_END)
        ends_cleanly = end == 0 or (fh.seek(end - 1) >= 0 and fh.read(1) == b"\n")
        fh.write((b"" if ends_cleanly else b"\n") + line.encode() + b"\n")
