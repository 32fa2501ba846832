"""Any gym-style text environment, from its package, unchanged.

The package gives a factory (``env_config.factory``, ``module:callable``, called with
``env_config.kwargs``) that returns an object with ``reset(seed=..., options=...)`` and
``step(action)``:
- ``reset`` returns the first observation, or ``(observation, info)``;
- ``step`` returns ``(observation, reward, terminated, truncated, info)`` (gymnasium) or
  ``(observation, reward, done, info)`` (classic gym).
Observations are text (anything else is shown with ``str``). ``task_data.options``, if given,
is passed to ``reset`` as ``options``. The episode's reward is the sum of the step rewards; each
step's reward and info are kept on its turn.

Runs in a host of its own (``hosted``): by default a process, so a package that seeds or draws
from the process-global ``random`` cannot mix up concurrent episodes.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from services.rollout_worker.environments.hosted import HostedConfig, HostedEnv
from shared.import_path import import_callable


class GymTextConfig(HostedConfig):
    factory: str = Field(description="module:callable returning the gym-style environment")
    kwargs: dict[str, Any] = Field(default_factory=dict)


class GymDriver:
    def __init__(self, factory: str, kwargs: dict[str, Any]):
        self.env = import_callable(factory, "env_config.factory")(**kwargs)
        self.total = 0.0
        self.steps = 0

    def reset(self, task_data: dict[str, Any], seed: int) -> list[dict[str, str]]:
        options = task_data.get("options")
        first = self.env.reset(seed=seed, options=options) if options is not None else self.env.reset(seed=seed)
        observation = first[0] if isinstance(first, tuple) else first
        return [{"role": "user", "content": str(observation)}]

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        result = self.env.step(action)
        if len(result) == 5:
            observation, reward, terminated, truncated, info = result
            done = bool(terminated) or bool(truncated)
            info = {**dict(info or {}), "terminated": bool(terminated), "truncated": bool(truncated)}
        elif len(result) == 4:
            observation, reward, done, info = result
        else:
            raise TypeError(f"step() returned {len(result)} values; expected 5 (gymnasium) or 4 (gym)")
        self.total += float(reward)
        self.steps += 1
        return str(observation), float(reward), bool(done), dict(info or {})

    def verify(self) -> tuple[float, dict[str, Any]]:
        return self.total, {"steps": self.steps}

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


class GymTextEnv(HostedEnv):
    name = "gym"
    Config = GymTextConfig
    config: GymTextConfig
    driver_path = "services.rollout_worker.environments.gym_text:GymDriver"

    def driver_options(self) -> dict[str, Any]:
        return {"factory": self.config.factory, "kwargs": dict(self.config.kwargs)}
