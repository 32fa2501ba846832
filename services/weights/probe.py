"""Asking a replica what it serves: prompt logprobs of the probe sequence (``services.policy.probe``).

Invariants:
- The probe request is an ordinary ``/v1/completions`` call (token ids in, ``max_tokens=1``,
  ``prompt_logprobs=0``, temperature 1), so it runs the replica's real kernels: a tensor
  that was reloaded but not re-processed for them shows here, as no checksum of parameters
  would.
- ``verify_replica`` raises ``ProbeMismatch`` with the figures whenever the replica's logprobs
  differ from the trainer's by more than the tolerance (or are not numbers), and never
  otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from services.weights.admin_http import admin_request
from services.policy.probe import LogprobProbe, ProbeResult, compare

PROBE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class SyncProbe:
    """What a sync checks on each replica after reloading: ``probe`` under ``model``."""

    probe: LogprobProbe
    model: str
    tolerance: float


class ProbeMismatch(RuntimeError):
    def __init__(self, base_url: str, version: int, result: ProbeResult):
        super().__init__(
            f"{base_url} does not serve the trainer's weights of version {version}: probe logprobs differ by "
            f"max {result.max_abs_diff:.3g} (mean {result.mean_abs_diff:.3g}) > tolerance {result.tolerance:.3g}")
        self.base_url, self.version, self.result = base_url, version, result


def _token_logprob(entry: Any, token_id: int) -> float:
    if not isinstance(entry, dict):
        raise ValueError(f"prompt logprob entry is {entry!r}, not an object")
    item = entry.get(str(token_id), entry.get(token_id))
    if not isinstance(item, dict) or "logprob" not in item:
        raise ValueError(f"prompt logprobs lack token {token_id}: {entry!r}")
    return float(item["logprob"])


def served_prompt_logprobs(client: httpx.Client, base_url: str, model: str, token_ids: list[int]) -> list[float]:
    """``[log p(t[i+1] | t[:i+1])]`` from the replica's prompt logprobs at temperature 1."""
    body = {"model": model, "prompt": token_ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
    response = admin_request(client, "POST", base_url, "/v1/completions", call="probe", retry_5xx=True, json=body,
                        timeout=httpx.Timeout(PROBE_TIMEOUT_S, connect=5.0))
    try:
        entries = response.json()["choices"][0]["prompt_logprobs"]
        return [_token_logprob(entry, tok) for entry, tok in zip(entries[1:], token_ids[1:], strict=True)]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ValueError(f"{base_url} answered the probe without usable prompt logprobs: {exc}") from None


def verify_replica(client: httpx.Client, base_url: str, check: SyncProbe) -> ProbeResult:
    """Compare the replica's probe logprobs with the trainer's; raise ``ProbeMismatch`` if off."""
    served = served_prompt_logprobs(client, base_url, check.model, check.probe.token_ids)
    result = compare(check.probe.logprobs, served, check.tolerance)
    if not result.ok:
        raise ProbeMismatch(base_url, check.probe.version, result)
    return result
