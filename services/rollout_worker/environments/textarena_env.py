"""textarena's single-player games, from the ``textarena`` package, unchanged.

``env_config.env_id`` names the game (``GuessTheNumber-v0-raw``, ``Wordle-v0-raw``, ...),
``env_config.kwargs`` are passed to ``textarena.make``. The ``-raw`` ids give the game's own
messages; each observation is then the game's messages since the agent's last action, every
``ObservationType`` but ``PLAYER_ACTION`` (the agent's own move, which some games echo as the
game's). A wrapped id gives textarena's rendered string, passed on as it is.

The game ends when textarena says so; its reward for player 0 (from ``env.close()``) is the
last turn's reward and the episode's. textarena seeds the process-global ``random`` in
``reset``: keep the default ``isolation: process``.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from services.rollout_worker.environments.hosted import HostedConfig, HostedEnv

PLAYER = 0


class TextArenaConfig(HostedConfig):
    env_id: str = Field(description="a textarena id, e.g. GuessTheNumber-v0-raw")
    kwargs: dict[str, Any] = Field(default_factory=dict)


def _as_text(observation: Any) -> str:
    if isinstance(observation, str):
        return observation
    return "\n".join(str(item[1]) for item in observation if _for_the_agent(item))


def _for_the_agent(item: Any) -> bool:
    """Whether a ``(sender, text, ObservationType)`` message is news to the agent: every type but
    ``PLAYER_ACTION``, the agent's own move, which some games (TowerOfHanoi) send back as the
    game (sender -1). Chosen by what a message is, not by who sent it."""
    from textarena.core import ObservationType

    return isinstance(item, tuple) and len(item) >= 3 and item[2] != ObservationType.PLAYER_ACTION


class TextArenaDriver:
    def __init__(self, env_id: str, kwargs: dict[str, Any]):
        import textarena

        self.env = textarena.make(env_id, **kwargs)
        self.reward = 0.0
        self.game_info: dict[str, Any] = {}
        self.closed = False

    def reset(self, task_data: dict[str, Any], seed: int) -> list[dict[str, str]]:
        self.env.reset(num_players=1, seed=seed)
        _, observation = self.env.get_observation()
        return [{"role": "user", "content": _as_text(observation)}]

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        done, info = self.env.step(action=action)
        if not done:
            _, observation = self.env.get_observation()
            return _as_text(observation), 0.0, False, dict(info or {})
        rewards, game_info = self.env.close()
        self.closed = True
        self.reward = float(rewards.get(PLAYER, 0.0))
        self.game_info = {k: v for k, v in (game_info or {}).get(PLAYER, {}).items() if isinstance(v, (str, int, float, bool))}
        return self.game_info.get("reason", ""), self.reward, True, dict(self.game_info)

    def verify(self) -> tuple[float, dict[str, Any]]:
        return self.reward, dict(self.game_info)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.env.close()
            except Exception:  # a game closed before it ended may have no outcome to report
                pass


class TextArenaEnv(HostedEnv):
    name = "textarena"
    Config = TextArenaConfig
    config: TextArenaConfig
    driver_path = "services.rollout_worker.environments.textarena_env:TextArenaDriver"

    def driver_options(self) -> dict[str, Any]:
        return {"env_id": self.config.env_id, "kwargs": dict(self.config.kwargs)}
