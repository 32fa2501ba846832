"""skyrl-gym's text environments (``BaseTextEnv``), from the ``skyrl-gym`` package, unchanged.

``env_config.env_class`` names the environment as ``skyrl_gym.make`` knows it (``gsm8k``,
``gsm8k_multi_turn``, ...); ``env_config.skyrl_config`` is its own config object. Rows are
SkyRL's dataset rows: ``prompt`` (a list of chat messages, or a string) plus the fields SkyRL
hands the environment as ``extras`` (``reward_spec``, ``extra_info``, ...).

Each step's observations (a list of messages) become one observation, their contents joined;
each step's reward and metadata are kept on its turn. The episode's reward is the last step's
(``episode_reward: last``, SkyRL's outcome reward) or their sum (``sum``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from services.rollout_worker.environments.hosted import HostedConfig, HostedEnv
from shared.environments import RowRejected


class SkyRLGymConfig(HostedConfig):
    env_class: str = Field(description="a skyrl_gym id, e.g. gsm8k")
    skyrl_config: dict[str, Any] = Field(default_factory=dict)  # the environment's own env_config
    episode_reward: Literal["last", "sum"] = "last"


class SkyRLDriver:
    def __init__(self, env_class: str, skyrl_config: dict[str, Any], episode_reward: str):
        self.env_class, self.skyrl_config, self.episode_reward = env_class, skyrl_config, episode_reward
        self.rewards: list[float] = []
        self.metadata: dict[str, Any] = {}
        self.env: Any = None

    def reset(self, task_data: dict[str, Any], seed: int) -> list[dict[str, str]]:
        import skyrl_gym
        from omegaconf import OmegaConf

        self.env = skyrl_gym.make(self.env_class, env_config=OmegaConf.create(self.skyrl_config),
                                  extras=dict(task_data["extras"]))
        prompt, self.metadata = self.env.init(list(task_data["prompt"]))
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        output = self.env.step(action)
        self.rewards.append(float(output["reward"]))
        observation = "\n".join(str(m.get("content", "")) for m in output.get("observations") or [])
        return observation, float(output["reward"]), bool(output["done"]), dict(output.get("metadata") or {})

    def verify(self) -> tuple[float, dict[str, Any]]:
        if not self.rewards:
            return 0.0, {}
        reward = self.rewards[-1] if self.episode_reward == "last" else sum(self.rewards)
        return reward, {"metrics": self.env.get_metrics()}

    def close(self) -> None:
        if self.env is not None:
            self.env.close()


class SkyRLGymEnv(HostedEnv):
    name = "skyrl_gym"
    Config = SkyRLGymConfig
    config: SkyRLGymConfig
    driver_path = "services.rollout_worker.environments.skyrl_gym_env:SkyRLDriver"

    @classmethod
    def task_from_row(cls, data: dict[str, Any]) -> dict[str, Any]:
        prompt = data.get("prompt")
        if isinstance(prompt, str) and prompt.strip():
            prompt = [{"role": "user", "content": prompt}]
        if (not isinstance(prompt, list) or not prompt
                or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                           for m in prompt)):
            raise RowRejected("field 'prompt' must be a string or a non-empty list of {role, content} messages")
        extras = {k: v for k, v in data.items() if k not in ("prompt", "env_class", "id", "env_key", "env_name")}
        return {"prompt": prompt, "extras": extras}

    def driver_options(self) -> dict[str, Any]:
        return {"env_class": self.config.env_class, "skyrl_config": dict(self.config.skyrl_config),
                "episode_reward": self.config.episode_reward}
