"""Where the policy's weights and tokenizer come from: ``inference.model_path`` read as either a
local checkpoint directory or a Hugging Face model name.

Invariants:
- A value that names an existing directory is a local checkpoint, whatever its shape.
- A value that looks like a path (absolute, starting with ``./``, ``../`` or ``~``, or naming
  something that exists) but is not a directory is refused: it is never sent to the Hub.
- Otherwise a value shaped like ``org/name`` (the Hub's own rules: letters, digits, ``-``,
  ``_``, ``.``, no ``--`` or ``..``, at most 96 characters) is a Hugging Face model name; any
  other value is refused. Every refusal is a ``ModelSourceError`` naming the setting.
- ``require_available`` refuses a model name that is not in the local cache when the Hub
  cannot give it: offline (``HF_HUB_OFFLINE``), or online with no answer from the Hub's endpoint
  (``HF_ENDPOINT``) within ``HUB_PROBE_TIMEOUT_S`` (one HEAD request; ``probe_hub=False`` skips
  it where nothing is loaded). The refusal is one ``ModelSourceError`` naming the model, the
  cache, why the Hub cannot give it and the cure. A name the Hub answers for is not looked up
  further here; the first ``from_pretrained`` (vLLM's, the trainer's) downloads it into the cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SETTING = "inference.model_path"
TINY_MODEL_HINT = "`conveyor tiny-model DIR` writes a test checkpoint"
HUB_PROBE_TIMEOUT_S = 5.0


class ModelSourceError(ValueError):
    """``inference.model_path`` is neither a usable directory nor a usable model name."""


@dataclass(frozen=True)
class ModelSource:
    value: str  # what vLLM's --model and transformers' from_pretrained get
    local_dir: Path | None  # None: a Hugging Face model name

    @property
    def is_hub_name(self) -> bool:
        return self.local_dir is None

    def describe(self) -> str:
        if self.local_dir is not None:
            return f"{SETTING}: the local checkpoint {self.local_dir}"
        return (f"{SETTING}: {self.value} is not a local directory: it is used as a Hugging Face model name "
                f"(vLLM and transformers load it from the Hub cache, downloading it there if it is missing)")

    def require_available(self, probe_hub: bool = True) -> ModelSource:
        """Return self, or raise ``ModelSourceError`` when the name is not cached and the Hub cannot give it."""
        if self.local_dir is not None:
            return self
        from huggingface_hub import constants, try_to_load_from_cache

        if isinstance(try_to_load_from_cache(self.value, "config.json"), str):
            return self
        why = _why_the_hub_cannot_give_it(probe_hub)
        if why is None:
            return self
        raise ModelSourceError(
            f"{SETTING}: {self.value} is neither a local directory nor in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}), and {why}: download it first "
            f"(`hf download {self.value}`) or set {SETTING} to a local checkpoint directory")


def resolve_model_source(value: str | os.PathLike[str]) -> ModelSource:
    """``inference.model_path`` as a local checkpoint or a Hub model name (rules in the module docstring)."""
    text = os.fspath(value).strip()
    if not text:
        raise ModelSourceError(f"{SETTING} is empty: set it to a checkpoint directory or a Hugging Face model name "
                               f"(org/name); {TINY_MODEL_HINT}")
    path = Path(text).expanduser()
    if path.is_dir():
        return ModelSource(str(path), path)
    if _looks_like_a_path(text, path):
        raise ModelSourceError(f"{SETTING}: {text} is not a directory (a checkpoint with its tokenizer; "
                               f"{TINY_MODEL_HINT})")
    if not _is_hub_name(text):
        raise ModelSourceError(f"{SETTING}: {text!r} is neither a local directory nor a Hugging Face model name "
                               f"(org/name, e.g. Qwen/Qwen2.5-0.5B-Instruct); {TINY_MODEL_HINT}")
    return ModelSource(text, None)


def _looks_like_a_path(text: str, path: Path) -> bool:
    return path.is_absolute() or text.startswith(("./", "../", "~")) or text in (".", "..") or path.exists()


def _is_hub_name(text: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if text.count("/") != 1:
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def _why_the_hub_cannot_give_it(probe_hub: bool) -> str | None:
    if _hub_offline():
        return "the Hub is offline (HF_HUB_OFFLINE)"
    return _hub_unreachable() if probe_hub else None


def _hub_unreachable() -> str | None:
    """Why the Hub's endpoint gave no answer, or None where it answered (any HTTP status)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_TIMEOUT_S)
    except Exception as exc:  # no answer, whatever the transport names as the reason
        return (f"the Hub at {constants.ENDPOINT} is unreachable ({type(exc).__name__}: {exc}; "
                f"HF_HUB_OFFLINE=1 says offline at once)")
    return None


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)
