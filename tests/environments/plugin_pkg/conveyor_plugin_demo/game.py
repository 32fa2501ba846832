"""A gym-style text game written as many packages are: synchronous, and drawing its secret
from the process-global ``random`` after seeding it in ``reset``."""

from __future__ import annotations

import os
import random
import time


class SecretGame:
    def __init__(self, high: int = 1000, step_sleep_s: float = 0.0, crash_on_step: bool = False):
        self.high, self.step_sleep_s, self.crash_on_step = high, step_sleep_s, crash_on_step

    def reset(self, seed=None, options=None):
        random.seed(seed)
        time.sleep(self.step_sleep_s)  # another episode's reset may run meanwhile
        self.secret = random.randint(1, self.high)
        self.turns = 0
        return f"secret game {self.secret}: say the secret back", {"high": self.high}

    def step(self, action: str):
        if self.crash_on_step:
            os._exit(3)  # a native crash takes its process down
        time.sleep(self.step_sleep_s)  # blocks, as a synchronous package does
        self.turns += 1
        won = str(self.secret) in action
        return ("right" if won else "wrong"), (1.0 if won else 0.0), won, self.turns >= 3, {"turn": self.turns}
