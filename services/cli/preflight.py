"""Checks a command makes before it starts work: what it needs is there and fits.

Invariant: these read settings, the environment registry and the model's files, and write
nothing; a failure is a ``CommandError``-style line (``services.cli.errors``) naming the setting.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from shared.settings import Settings

if TYPE_CHECKING:  # imported where used: the model check loads only what it runs
    from shared.model_source import ModelSource


def check_environments(settings: Settings) -> None:
    """Every plugin in settings resolves, and intake.env_config fits intake.env_name's Config:
    a deployment that cannot run its environment stops here, before it takes or sends work."""
    from shared.environments import check_startup, registry_for

    check_startup(registry_for(settings.environments), settings.intake.env_name, settings.intake.env_config,
                  settings.environments)


def require_model(settings: Settings) -> "ModelSource":
    """``inference.model_path`` as a local checkpoint or a Hugging Face model name that can be
    loaded (``shared.model_source``); a hub name is said in the log."""
    from shared.model_source import resolve_model_source

    source = resolve_model_source(settings.inference.model_path).require_available()
    if source.is_hub_name:
        logging.getLogger("conveyor").info("%s", source.describe())
    return source
