"""Where and in what precision the trainer computes (``trainer.device``, ``trainer.dtype``).

Invariants:
- ``auto`` is cuda when torch sees a GPU, else cpu; asking for cuda where there is none stops
  the trainer at start with the reason, never falls back silently.
- bf16 is mixed precision: the weights, their gradients and the optimizer state stay float32
  (the master copy every checkpoint is written from); forward and backward run under
  ``torch.autocast`` in bfloat16, and logprobs are taken in float32 (``policy.sequence_logprobs``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device is cuda but torch sees no GPU (torch.cuda.is_available() is False); "
                           "set trainer.device to auto or cpu")
    return torch.device(name)


@contextlib.contextmanager
def compute_precision(device: torch.device, dtype: str) -> Iterator[None]:
    if dtype == "bf16":
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            yield
    else:
        yield
