"""Intake's limit on prompts: a task whose prompt cannot fit the model's context is rejected at
intake, naming both lengths, instead of failing every episode of its group.

Invariant: the check counts the prompt text the environment names (``prompt_text``) with the
policy's own tokenizer; it runs only where the model directory is readable (intake on a
machine without the model skips it, and says so once).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from shared.environments import RowRejected
from shared.schemas import TaskProfile
from shared.settings import Settings

log = logging.getLogger(__name__)


class PromptLimit:
    def __init__(self, count_tokens: Callable[[str], int], max_model_len: int):
        self.count_tokens, self.max_model_len = count_tokens, max_model_len

    @classmethod
    def from_settings(cls, settings: Settings) -> "PromptLimit | None":
        model = Path(settings.inference.model_path)
        if not (model / "config.json").is_file():
            log.info("no model at %s: prompt lengths are not checked at intake", model)
            return None
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model))
        return cls(lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]),
                   settings.inference.max_model_len)

    def check(self, task: TaskProfile, prompt: str | None) -> None:
        if prompt is None:
            return
        tokens = self.count_tokens(prompt)
        if tokens >= self.max_model_len:
            raise RowRejected(f"prompt is {tokens} tokens, no room in the model's context of {self.max_model_len} "
                              "(inference.max_model_len)")
