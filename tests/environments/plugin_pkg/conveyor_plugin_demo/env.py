"""The Conveyor side of the plugin: the generic gym adapter, with this package's game as its
default factory."""

from __future__ import annotations

from services.rollout_worker.environments.gym_text import GymTextConfig, GymTextEnv


class SecretGameConfig(GymTextConfig):
    factory: str = "conveyor_plugin_demo.game:SecretGame"


class SecretGameEnv(GymTextEnv):
    name = "secret_game"
    Config = SecretGameConfig
