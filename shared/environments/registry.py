"""Where environment names resolve: one registry, used by intake and by every rollout worker.

Sources, later ones overriding earlier ones by name:
1. Conveyor's built-in environments (``BUILTIN``, import paths loaded on first use);
2. the ``conveyor.environments`` entry point group of every installed distribution
   (``[project.entry-points."conveyor.environments"] my_game = "my_pkg.env:MyGame"``);
3. ``environments`` in settings, ``{name: "module:Class"}``.

Invariants:
- Resolving a name imports only that environment's module. An unknown name, or a path that does
  not import or is not an ``Environment`` subclass, is ``EnvironmentUnavailable`` with one line
  that names it and the registered names; it never surfaces as a ``KeyError``.
- ``check_startup`` runs at the start of intake and of the rollout worker: every environment
  named in settings resolves, and ``intake.env_config`` validates against the configured
  environment's ``Config``. A deployment that cannot run its environment stops before it takes
  or publishes any work.
"""

from __future__ import annotations

import importlib.metadata
import threading
from collections.abc import Mapping
from typing import Any

from shared.environments.protocol import (EnvConfig, Environment, EnvironmentConfigError, EnvironmentUnavailable,
                                          validate_config)
from shared.import_path import ImportPathError, import_callable

ENTRY_POINT_GROUP = "conveyor.environments"

BUILTIN: dict[str, str] = {
    "guess_number": "services.rollout_worker.environments.guess_number:GuessNumberEnv",
    "qa": "services.rollout_worker.environments.qa:QuestionAnswerEnv",
    "single_turn": "services.rollout_worker.environments.single_turn:SingleTurnEnv",
    "coding": "services.rollout_worker.environments.coding.env:CodingEnv",
    "agent_coding": "services.rollout_worker.environments.agent_coding:AgentCodingEnv",
    "gym": "services.rollout_worker.environments.gym_text:GymTextEnv",
    "textarena": "services.rollout_worker.environments.textarena_env:TextArenaEnv",
    "skyrl_gym": "services.rollout_worker.environments.skyrl_gym_env:SkyRLGymEnv",
    "mcp": "services.rollout_worker.environments.mcp_tools:McpToolEnv",
}


def _entry_points() -> dict[str, str]:
    found: dict[str, str] = {}
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        found[entry.name] = entry.value
    return found


class EnvironmentRegistry:
    def __init__(self, extra: Mapping[str, str] | None = None, *, entry_points: bool = True):
        self.extra: dict[str, str] = dict(extra or {})
        self.paths: dict[str, str] = dict(BUILTIN)
        self.sources: dict[str, str] = {name: "built-in" for name in BUILTIN}
        if entry_points:
            for name, path in _entry_points().items():
                self.paths[name], self.sources[name] = path, f"entry point {ENTRY_POINT_GROUP}:{name}"
        for name, path in (extra or {}).items():
            self.paths[name], self.sources[name] = path, f"settings environments.{name}"
        self._loaded: dict[str, type[Environment]] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return sorted(self.paths)

    def resolve(self, name: str) -> type[Environment]:
        with self._lock:
            if name in self._loaded:
                return self._loaded[name]
        if not isinstance(name, str) or name not in self.paths:
            raise EnvironmentUnavailable(f"unknown environment {name!r}; registered: {', '.join(self.names())} "
                                         f"(add one with the {ENTRY_POINT_GROUP!r} entry point group or "
                                         "settings 'environments: {name: module:Class}')")
        where = self.sources[name]
        try:
            env_type = import_callable(self.paths[name], f"environment {name!r} ({where})")
        except ImportPathError as exc:
            raise EnvironmentUnavailable(str(exc)) from None
        if not (isinstance(env_type, type) and issubclass(env_type, Environment)):
            raise EnvironmentUnavailable(f"environment {name!r} ({where}): {self.paths[name]} is not a subclass of "
                                         "shared.environments.Environment")
        if not issubclass(env_type.Config, EnvConfig):
            raise EnvironmentUnavailable(f"environment {name!r} ({where}): its Config must subclass "
                                         "shared.environments.EnvConfig")
        with self._lock:
            self._loaded[name] = env_type
        return env_type

    def config(self, name: str, env_config: dict[str, Any] | None) -> EnvConfig:
        return validate_config(self.resolve(name), env_config or {})

    def make(self, name: str, env_config: dict[str, Any] | None) -> Environment:
        env_type = self.resolve(name)
        return env_type(validate_config(env_type, env_config or {}))


def check_startup(registry: EnvironmentRegistry, env_name: str, env_config: dict[str, Any] | None,
                  plugins: Mapping[str, str] | None = None) -> None:
    """Raises ``EnvironmentUnavailable`` / ``EnvironmentConfigError`` with one clear line."""
    for name in (plugins or {}):
        registry.resolve(name)
    registry.config(env_name, env_config)


_default: EnvironmentRegistry | None = None
_default_lock = threading.Lock()


def registry_for(plugins: Mapping[str, str] | None = None) -> EnvironmentRegistry:
    """The process's registry for these settings' plugins (built once per distinct mapping)."""
    global _default
    key = dict(plugins or {})
    with _default_lock:
        if _default is None or _default.extra != key:
            _default = EnvironmentRegistry(key)
        return _default

__all__ = ["BUILTIN", "ENTRY_POINT_GROUP", "EnvironmentConfigError", "EnvironmentRegistry", "EnvironmentUnavailable",
           "check_startup", "registry_for"]
