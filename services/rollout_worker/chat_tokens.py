"""Token ids for prompts and observations, from the policy's own tokenizer and chat template.

Invariant: earlier turns are never re-tokenized. The initial prompt is rendered once; each
later turn only appends the ids of the text that closes the assistant turn, carries the
observation and opens the next assistant turn. That text is derived from the model's own chat
template (render a conversation around a placeholder and cut at it), so any template that
renders an assistant message as its content followed by an end marker works. That includes
templates that rewrite earlier turns (Qwen3's drops the reasoning of assistant turns before
the last user message): the placeholder has no reasoning to drop, and nothing rendered before
is rendered again, so sampled reasoning stays in the context as sampled
(``tests/agents/test_rewriting_template.py``).

The ids of recent initial prompts are kept, by their messages and tools as JSON (key order
included, as the template may render it): a group's members all start from the same prompt,
rendered once for the group. Every caller gets a list of its own. The cache holds at most
``cache_bytes`` (each entry counts its key's length plus 8 bytes an id, as stored), the least
recently used leaving first; a prompt bigger than that is not kept. ``forget`` drops the
entries of given keys (the proxy's, when a session ends).
"""

from __future__ import annotations

import json
import threading
from array import array
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from services.rollout_worker.tokenizer_loading import load_tokenizer

_PLACEHOLDER = "\u2063PLACEHOLDER\u2063"
_OBSERVATION = "\u2063OBSERVATION\u2063"
CACHE_BYTES = 64 * 1024 * 1024


class ChatTokens:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, observation_role: str = "user", cache_bytes: int = CACHE_BYTES):
        self.tokenizer = tokenizer
        self.observation_role = observation_role
        self.eos_token_id = tokenizer.eos_token_id
        self.eos_text = tokenizer.eos_token or ""
        # observation frame per role, found on first use
        self._frames: dict[str, tuple[str, str] | tuple[()]] = {}
        self.cache_bytes = cache_bytes
        self._prompts: OrderedDict[str, array] = OrderedDict()  # recent initial prompts, at most cache_bytes
        self._prompts_size = 0
        self._prompts_lock = threading.Lock()

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` argument (else tools must go in a message)."""
        return "tools" in (self.tokenizer.chat_template or "")

    def initial_prompt(self, messages: list[dict], tools: list[dict] | None = None, keys: set[str] | None = None) -> list[int]:
        """``tools``: passed to the template (only for one that ``renders_tools``). ``keys``: gets
        this prompt's cache key (for ``forget``)."""
        try:
            key = json.dumps([messages, tools or None])
        except (TypeError, ValueError):  # not JSON: rendered each time
            return self._render_prompt(messages, tools)
        if keys is not None:
            keys.add(key)
        with self._prompts_lock:
            ids = self._prompts.get(key)
            if ids is not None:
                self._prompts.move_to_end(key)
                return ids.tolist()
        ids = array("q", self._render_prompt(messages, tools))
        self._keep(key, ids)
        return ids.tolist()

    @staticmethod
    def _entry_bytes(key: str, ids: array) -> int:
        return len(key) + ids.itemsize * len(ids)

    def _keep(self, key: str, ids: array) -> None:
        size = self._entry_bytes(key, ids)
        if size > self.cache_bytes:
            return
        with self._prompts_lock:
            self._drop(key)
            self._prompts[key] = ids
            self._prompts_size += size
            while self._prompts_size > self.cache_bytes:
                self._drop(next(iter(self._prompts)))

    def _drop(self, key: str) -> None:
        ids = self._prompts.pop(key, None)
        if ids is not None:
            self._prompts_size -= self._entry_bytes(key, ids)

    def forget(self, keys: set[str]) -> None:
        with self._prompts_lock:
            for key in keys:
                self._drop(key)

    @property
    def cached_bytes(self) -> int:
        return self._prompts_size

    def _render_prompt(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        extra = {"tools": tools} if tools else {}
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def observation_ids(self, observation: str, sampled_ended_with_eos: bool, role: str | None = None) -> list[int]:
        """``role``: the chat role of the observation (the environment's; default ``observation_role``)."""
        return self._ids_of_delta(self._observation_text(observation, role or self.observation_role), sampled_ended_with_eos)

    def ids_after_assistant(self, messages: list[dict], sampled_ended_with_eos: bool, tools: list[dict] | None = None) -> list[int]:
        """The ids that close the last assistant turn, carry ``messages`` and open the next
        assistant turn: what a conversation that continues after a sampled reply appends."""
        extra = {"tools": tools} if tools else {}
        return self._ids_of_delta(self._text_after_assistant(messages, **extra), sampled_ended_with_eos)

    def _ids_of_delta(self, delta: str, sampled_ended_with_eos: bool) -> list[int]:
        if sampled_ended_with_eos and self.eos_text and delta.startswith(self.eos_text):
            delta = delta[len(self.eos_text):]  # the model already sampled the end marker
        return list(self.tokenizer(delta, add_special_tokens=False)["input_ids"])

    def _observation_text(self, observation: str, role: str) -> str:
        """The text that closes the assistant turn, carries the observation and opens the next
        assistant turn. Rendered by the template once; later turns reuse its frame when the
        template leaves the observation as it is (checked on a sample), else render each time."""
        frame = self._frames.get(role)
        if frame is None:
            before, _, after = self._render_delta(_OBSERVATION, role).partition(_OBSERVATION)
            sample = "higher \n  lower "
            frame = (before, after) if self._render_delta(sample, role) == before + sample + after else ()
            self._frames[role] = frame
        if frame:
            return frame[0] + observation + frame[1]
        return self._render_delta(observation, role)

    def _render_delta(self, observation: str, role: str) -> str:
        return self._text_after_assistant([{"role": role, "content": observation}])

    def _text_after_assistant(self, messages: list[dict], **template_kwargs) -> str:
        rendered = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PLACEHOLDER}, *messages],
            add_generation_prompt=True, tokenize=False, **template_kwargs,
        )
        return rendered[rendered.index(_PLACEHOLDER) + len(_PLACEHOLDER):]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


@lru_cache(maxsize=4)
def load_chat_tokens(model_path: str | Path, cache_bytes: int = CACHE_BYTES) -> ChatTokens:
    return ChatTokens(load_tokenizer(model_path), cache_bytes=cache_bytes)
