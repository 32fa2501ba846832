"""Trials: several episodes of one task in one trajectory (``env_config.episodes_per_trial``),
the agent keeping in its context what the earlier episodes taught it (the seeds' MultistepEnv).

Invariants:
- Every episode of a trial plays the same task instance (``reset`` with the group's task seed);
  between two episodes the environment is closed and reset, and the next episode's opening
  messages (system messages left out) reach the agent as one observation, headed
  ``Episode k of n``.
- The first ``free_shots`` episodes are practice: their rewards are kept in the info but do not
  count. The trajectory's reward is the mean over the counted episodes, an episode the budget
  left unplayed counting 0. With one episode per trial (the default) it is that episode's reward
  and info, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shared.environments import VerifyResult


@dataclass
class Trial:
    episodes: int = 1
    free_shots: int = 0
    verdicts: list[VerifyResult] = field(default_factory=list)

    def record(self, verdict: VerifyResult) -> None:
        self.verdicts.append(verdict)

    @property
    def complete(self) -> bool:
        return len(self.verdicts) >= self.episodes

    def opening(self, messages: list[dict[str, str]]) -> str:
        """The next episode's opening messages as one observation."""
        text = "\n".join(m["content"] for m in messages if m.get("role") != "system")
        return f"Episode {len(self.verdicts) + 1} of {self.episodes}.\n{text}"

    def result(self) -> tuple[float, dict[str, Any]]:
        if self.episodes == 1:
            verdict = self.verdicts[0]
            return verdict.reward, verdict.info
        rewards = [v.reward for v in self.verdicts]
        counted = rewards[self.free_shots:]
        reward = sum(counted) / (self.episodes - self.free_shots)
        return reward, {"episode_rewards": rewards, "free_shots": self.free_shots, "episodes_played": len(rewards),
                        "last_episode": self.verdicts[-1].info if self.verdicts else {}}
