"""Environment registry: ``env_name`` in a task profile -> environment class."""

from __future__ import annotations

from services.rollout_worker.environments.base import Environment
from services.rollout_worker.environments.coding import CodingEnv
from services.rollout_worker.environments.guess_number import GuessNumberEnv
from services.rollout_worker.environments.qa import QuestionAnswerEnv
from services.rollout_worker.environments.single_turn import SingleTurnEnv

ENVIRONMENTS: dict[str, type[Environment]] = {
    GuessNumberEnv.name: GuessNumberEnv,
    QuestionAnswerEnv.name: QuestionAnswerEnv,
    SingleTurnEnv.name: SingleTurnEnv,
    CodingEnv.name: CodingEnv,
}


def make_environment(env_name: str, env_config: dict | None = None) -> Environment:
    try:
        env_type = ENVIRONMENTS[env_name]
    except KeyError:
        raise KeyError(f"unknown environment {env_name!r}; known: {sorted(ENVIRONMENTS)}") from None
    return env_type(env_config)
