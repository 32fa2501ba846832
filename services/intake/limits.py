"""Intake's limit on prompts: a task whose prompt cannot fit the model's context is rejected at
intake, naming both lengths, instead of failing every episode of its group.

Invariant: the check counts the prompt text the environment names (``prompt_text``) with the
policy's own tokenizer; it runs only where that tokenizer is at hand: the model directory is
readable, or ``inference.model_path`` is a Hugging Face model name the Hub can give (online, or
cached). Intake on a machine without the model skips the check, and says so once.
"""

from __future__ import annotations

import logging
from typing import Callable

from shared.environments import RowRejected
from shared.model_source import ModelSourceError, resolve_model_source
from shared.schemas import TaskProfile
from shared.settings import Settings

log = logging.getLogger(__name__)


def _tokenizer_source(model_path: str) -> str | None:
    """What to load the policy's tokenizer from here, or None (logged) where there is none."""
    try:
        source = resolve_model_source(model_path).require_available()
    except ModelSourceError as exc:
        log.info("no model here (%s): prompt lengths are not checked at intake", exc)
        return None
    if source.local_dir is not None and not (source.local_dir / "config.json").is_file():
        log.info("no model at %s: prompt lengths are not checked at intake", source.local_dir)
        return None
    return source.value


class PromptLimit:
    def __init__(self, count_tokens: Callable[[str], int], max_model_len: int):
        self.count_tokens, self.max_model_len = count_tokens, max_model_len

    @classmethod
    def from_settings(cls, settings: Settings) -> "PromptLimit | None":
        model = _tokenizer_source(settings.inference.model_path)
        if model is None:
            return None
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        return cls(lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]),
                   settings.inference.max_model_len)

    def check(self, task: TaskProfile, prompt: str | None) -> None:
        if prompt is None:
            return
        tokens = self.count_tokens(prompt)
        if tokens >= self.max_model_len:
            raise RowRejected(f"prompt is {tokens} tokens, no room in the model's context of {self.max_model_len} "
                              "(inference.max_model_len)")
