"""The compose stack's GPU inference service: vLLM started inside vLLM's own GPU image with the
command line ``conveyor inference`` builds (``services.inference.vllm_command``), so the two
launches cannot drift apart.

Invariants:
- The options come from Conveyor's settings (``CONVEYOR_*`` variables, as in every service):
  the model (a local directory or a Hugging Face model name), served name, port, dtype, context,
  tensor parallelism, GPU memory share, and LoRA adapter serving when ``trainer.lora.enabled``
  with ``sync: adapter`` (``LoraSettings.served_rank``). The launch is always the GPU one.
- A bad setting or model is one line on stderr, ``error: <cause>``, and exit code 2; nothing starts.
- Otherwise this process becomes vLLM (exec): compose's signals reach vLLM and its exit code
  is the container's.
- ``--print`` writes the command and the environment it adds as JSON and starts nothing.

It imports only ``shared`` and the standard library's, pydantic's and Hugging Face's modules,
all of which vLLM's image has (the compose file mounts ``services`` and ``shared``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from services.inference.vllm_command import InferenceServerError, build_command, settings_options
from shared.model_source import ModelSourceError, resolve_model_source
from shared.settings import SettingsError, load_settings


def gpu_command(probe_hub: bool = True) -> tuple[list[str], dict[str, str]]:
    """``(argv, env_overrides)`` of the GPU launch from the settings; raises on a bad one.
    ``probe_hub``: ask the Hub whether it answers for a model name not in the cache (not for ``--print``)."""
    settings = load_settings()
    source = resolve_model_source(settings.inference.model_path).require_available(probe_hub)
    if source.is_hub_name:
        print(source.describe(), file=sys.stderr)
    return build_command(**settings_options(settings.inference, settings.trainer.lora.served_rank), gpu=True)


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Start vLLM on the GPU with Conveyor's settings.")
    parser.add_argument("--print", dest="print_only", action="store_true", help="print the command as JSON, start nothing")
    options = parser.parse_args(args)
    try:
        argv, env = gpu_command(probe_hub=not options.print_only)
    except (SettingsError, ModelSourceError, InferenceServerError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        raise SystemExit(2) from None
    if options.print_only:
        print(json.dumps({"argv": argv, "env": env}))
        return
    os.execve(argv[0], argv, {**os.environ, **env})


if __name__ == "__main__":
    main()
