"""From TrainingSamples to padded micro-batch tensors.

Invariants:
- The prompt is the tokens before the first loss-masked token. Truncation to ``max_seq_len``
  keeps the prompt and cuts the tail; cut tokens leave with their mask. A sample whose prompt
  leaves no room for one sampled token (or that has no prompt, or whose fields disagree in
  length) is dropped, and ``Prepared.dropped`` says which and why.
- DAPO overlong filtering: with ``mask_overlong``, a sample whose ``stop_reason`` is
  ``truncated`` (its last reply was cut at the per-turn token limit) keeps its place in the accounting but its loss mask is all zero: it
  contributes neither loss nor gradient. It is counted in ``overlong_masked``.
  A trajectory that ran out of its episode budget (``max_tokens``) or of the model's context
  (``context_exhausted``) is not masked: its turns are complete replies.
- Samples with no masked token carry no gradient, so they are never forwarded.
- A micro-batch's padded size (rows × longest row) is at most ``micro_batch_tokens``, and
  ``micro_batch_tokens >= max_seq_len`` so every sample fits in one. Sequences are
  right-padded with ``pad_token_id``; padding has attention 0, loss mask 0, logprob 0.
- Packing is deterministic: longest first, greedy, ties kept in input order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from shared.schemas import StopReason, TrainingSample
from shared.settings import BatchingSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedSample:
    trajectory_id: str
    token_ids: list[int]
    loss_mask: list[int]
    inference_logprobs: list[float]
    advantage: float
    policy_version: int = 0  # oldest policy version that produced the sample's tokens
    token_advantages: list[float] | None = None  # per token (trainer.token_rewards), else ``advantage``
    truncated: bool = False
    overlong_masked: bool = False

    @property
    def loss_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class Prepared:
    samples: list[PreparedSample] = field(default_factory=list)
    dropped: list[tuple[str, str]] = field(default_factory=list)  # (trajectory id, why)

    @property
    def trainable(self) -> list[PreparedSample]:
        return [s for s in self.samples if s.loss_tokens > 0]

    @property
    def truncated(self) -> int:
        return sum(s.truncated for s in self.samples)

    @property
    def overlong_masked(self) -> int:
        return sum(s.overlong_masked for s in self.samples)


def prepare_sample(sample: TrainingSample, max_seq_len: int, mask_overlong: bool = True) -> PreparedSample | str:
    """The sample ready to collate, or the reason it cannot be trained on."""
    n = len(sample.token_ids)
    if len(sample.loss_mask) != n or len(sample.inference_logprobs) != n:
        return (f"length mismatch: {n} token ids, {len(sample.loss_mask)} mask entries, "
                f"{len(sample.inference_logprobs)} logprobs")
    prompt_len = next((i for i, m in enumerate(sample.loss_mask) if m), n)
    if prompt_len == 0:
        return "no prompt: the first token is in the loss mask"
    if prompt_len >= max_seq_len:
        return f"prompt of {prompt_len} tokens leaves no room for a sampled token within max_seq_len={max_seq_len}"
    keep = min(n, max_seq_len)
    loss_mask = [1 if m else 0 for m in sample.loss_mask[:keep]]
    overlong = mask_overlong and sample.stop_reason == StopReason.truncated
    if overlong:
        loss_mask = [0] * keep
    return PreparedSample(
        trajectory_id=sample.trajectory_id,
        token_ids=list(sample.token_ids[:keep]),
        loss_mask=loss_mask,
        inference_logprobs=list(sample.inference_logprobs[:keep]),
        advantage=sample.advantage,
        policy_version=sample.oldest_policy_version,
        token_advantages=None if sample.token_advantages is None else list(sample.token_advantages[:keep]),
        truncated=keep < n,
        overlong_masked=overlong,
    )


def prepare_samples(samples: list[TrainingSample], settings: BatchingSettings) -> Prepared:
    prepared = Prepared()
    for sample in samples:
        result = prepare_sample(sample, settings.max_seq_len, settings.mask_overlong)
        if isinstance(result, str):
            log.warning("dropping sample %s: %s", sample.trajectory_id, result)
            prepared.dropped.append((sample.trajectory_id, result))
        else:
            prepared.samples.append(result)
    return prepared


def plan_micro_batches(samples: list[PreparedSample], token_budget: int) -> list[list[PreparedSample]]:
    """Longest-first greedy packing with rows × longest row <= token_budget."""
    ordered = sorted(samples, key=lambda s: -len(s.token_ids))
    plan: list[list[PreparedSample]] = []
    for sample in ordered:
        current = plan[-1] if plan else None
        # ordered longest first: the current batch's first row is its longest
        if current is not None and (len(current) + 1) * len(current[0].token_ids) <= token_budget:
            current.append(sample)
        else:
            plan.append([sample])
    return plan


@dataclass(frozen=True)
class MicroBatch:
    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] float32
    old_logprobs: torch.Tensor  # [B, T] float32, inference logprobs
    advantages: torch.Tensor  # [B] float32, or [B, T] when a sample carries per-token advantages
    policy_versions: torch.Tensor  # [B] long: the version each row was sampled by

    @property
    def tokens(self) -> int:
        """Real (non-padding) tokens."""
        return int(self.attention_mask.sum())

    def to(self, device: torch.device) -> "MicroBatch":
        return MicroBatch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.loss_mask, self.old_logprobs,
                                                    self.advantages, self.policy_versions)))


def masked_copy(mb: MicroBatch) -> MicroBatch:
    """``mb`` with no token in the loss: a pass that adds nothing (sharding pads ranks with it)."""
    return MicroBatch(mb.input_ids, mb.attention_mask, torch.zeros_like(mb.loss_mask), mb.old_logprobs, mb.advantages,
                      mb.policy_versions)


def collate(samples: list[PreparedSample], pad_token_id: int) -> MicroBatch:
    width = max(len(s.token_ids) for s in samples)
    rows = len(samples)
    input_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((rows, width), dtype=torch.long)
    loss_mask = torch.zeros((rows, width), dtype=torch.float32)
    old = torch.zeros((rows, width), dtype=torch.float32)
    for i, s in enumerate(samples):
        n = len(s.token_ids)
        input_ids[i, :n] = torch.tensor(s.token_ids, dtype=torch.long)
        attention[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        old[i, :n] = torch.tensor(s.inference_logprobs, dtype=torch.float32)
    if any(s.token_advantages is not None for s in samples):  # [B, T]: per token where given
        advantages = torch.zeros((rows, width), dtype=torch.float32)
        for i, s in enumerate(samples):
            n = len(s.token_ids)
            advantages[i, :n] = torch.tensor(s.token_advantages, dtype=torch.float32) if s.token_advantages is not None \
                else s.advantage
    else:
        advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    versions = torch.tensor([s.policy_version for s in samples], dtype=torch.long)
    return MicroBatch(input_ids, attention, loss_mask, old * loss_mask, advantages, versions)


def micro_batches(samples: list[PreparedSample], token_budget: int, pad_token_id: int) -> list[MicroBatch]:
    """Collated micro-batches of the samples that carry a loss token."""
    trainable = [s for s in samples if s.loss_tokens > 0]
    return [collate(group, pad_token_id) for group in plan_micro_batches(trainable, token_budget)]
