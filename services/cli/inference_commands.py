"""``conveyor inference`` (vLLM and its weight follower) and ``conveyor tiny-model``.

Invariants:
- ``inference --attach`` launches nothing: it follows weight updates for the servers at
  ``inference.base_url`` (or the ``--replica`` URLs).
- ``inference`` (launching) holds its server for the run (``shared.state.replica_holders``) before
  it starts it, under ``inference.base_url``: a run's follower attached to the same URL while the
  server loads is refused, and a refused launch starts nothing.
- ``tiny-model`` is a pure function of its options; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from services.cli import errors
from services.cli.command_support import ConfigOption, command_settings, console, setup_logging
from services.cli.preflight import require_model


def tiny_model(
    out_dir: Path = typer.Argument(..., help="directory to write the checkpoint to"),
    layout: str = typer.Option("llama", help="llama, llama-tied or qwen2"),
    seed: int = typer.Option(0),
) -> None:
    """Generate the tiny random test model (a pure function of its options; no download)."""
    from services.inference.tiny_model import generate_tiny_model

    try:
        generate_tiny_model(out_dir, seed=seed, end_of_turn_bias=4.0, layout=layout)
    except ValueError as exc:  # an unknown layout
        raise errors.CommandError(str(exc)) from exc
    console.print(f"tiny model ({layout}, seed {seed}) in {out_dir}")


def inference(
    config: Optional[Path] = ConfigOption,
    check: bool = typer.Option(False, "--check", help="only report the health of the configured server"),
    generate_tiny: bool = typer.Option(False, help="generate the tiny test model at inference.model_path first"),
    attach: bool = typer.Option(False, help="do not launch vLLM: follow weight updates for the server(s) at inference.base_url"),
    replica: Optional[list[str]] = typer.Option(None, help="with --attach: a replica base URL (repeatable)"),
) -> None:
    """Launch vLLM's OpenAI-compatible server for the configured model, wait until ready, and
    keep it on the newest checkpoint of the run (the weight-sync control plane)."""
    setup_logging()
    settings = command_settings(config)
    import threading

    from services.weights.base import BaseWeightsError, hold_replicas
    from services.weights.follower import WeightFollower
    from services.inference.server import VllmServer, check_inference
    from shared.required import required

    if check:
        health = check_inference(settings.inference.base_url)
        print(json.dumps(health))
        raise typer.Exit(0 if health.get("ok") else 1)
    stop = threading.Event()
    if settings.metrics_port:
        from shared.redis_clients import broker_client, redis_for
        from shared.prometheus import serve_metrics

        serve_metrics(settings.metrics_port, redis_for(settings.redis.url, settings.outage),
                      broker_client(settings.redis, settings.outage))
    if attach:
        with WeightFollower.from_settings(settings, base_urls=replica or None) as follower:
            try:
                follower.run(stop)
            except KeyboardInterrupt:
                stop.set()
            except BaseWeightsError as exc:
                raise errors.CommandError(str(exc)) from None
        return
    if generate_tiny:
        from services.inference.tiny_model import generate_tiny_model

        generate_tiny_model(Path(settings.inference.model_path))
    require_model(settings)
    server = VllmServer.from_settings(settings.inference, lora_rank=settings.trainer.lora.served_rank)
    failed: list[BaseWeightsError] = []

    def follow() -> None:
        try:
            follower.run(stop)
        except BaseWeightsError as exc:  # the run must not start on weights it did not check
            failed.append(exc)
            server.stop()

    # held under inference.base_url, the name the rest of the stack (a submitted run's follower
    # too) knows this server by, not under the loopback URL this process reaches it on; and held
    # before the server starts, so that no other run's follower takes it while it loads
    with WeightFollower.from_settings(settings, base_urls=[server.base_url],
                                      hold_names=[settings.inference.base_url]) as follower:
        try:
            hold_replicas(follower.hold)
        except BaseWeightsError as exc:
            raise errors.CommandError(str(exc)) from None
        server.start()
        try:
            server.wait_ready(settings.inference.startup_timeout_s, report_every_s=15)
            console.print(f"vLLM ready: {json.dumps(server.health())}")
            # server.stop() (the follower's failure) clears it
            process = required(server.process, "the vLLM server's process (start sets it)")
            thread = threading.Thread(target=follow, name="weight-follower", daemon=True)
            thread.start()
            process.wait()
            if failed:
                raise errors.CommandError(str(failed[0]))
        finally:
            stop.set()
            server.stop()
