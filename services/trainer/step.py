"""One optimizer step of GRPO over a list of training batches (GRPO groups).

Invariants:
- One ``train_step`` is one AdamW update of the loss of *all* its batches together. It runs
  in micro-batches by token budget and accumulates gradients; each micro-batch loss is
  divided by the whole step's denominator (masked tokens for token_mean, sequences with a
  masked token for seq_mean), so the accumulated gradient equals the full-batch gradient.
- Gradients are clipped to ``max_grad_norm`` on the accumulated gradient, before the update;
  ``grad_norm`` reports the norm before clipping.
- ``step`` counts applied updates. A step with no masked token at all (every sample dropped
  or overlong-masked) applies no update, leaves ``step`` unchanged and reports ``skipped=1``.
- The frozen reference exists only when ``kl_coef > 0``; it is the policy as it was when the
  trainer was built (or the one passed in). For a LoRA policy (a ``PeftModel``) with none
  passed in, it is the base with the adapters switched off (``disable_adapter``), not a copy:
  the base never trains, so that is the initial policy, at no extra memory.
- Logprobs are computed only from the first loss-masked position of each micro-batch on
  (``sequence_logprobs(needed=loss_mask)``): the loss, its statistics and the alarm read only
  loss-masked positions, so nothing changes but the work (``trim_prompt_logits=False`` computes
  every position, for comparison). ``logprob_chunk_tokens`` bounds the float32 logits held at once.
- The loss is ``trainer.loss`` (``services.trainer.loss``: kind and off-policy correction). One
  step is one update, so the proximal logprobs are the current ones detached: no extra forward.
  Every step reports the mismatch of behaviour (vLLM) and proximal (trainer) logprobs on its
  masked tokens: ``mismatch_kl`` and ``correction_masked_frac`` (token-weighted means over the
  micro-batches) and ``mismatch_ratio_p05/p50/p95`` (quantiles of their ratio, computed once
  over the step's tokens; under FSDP over the rank's own micro-batches).
- The logprob alarm (``services.trainer.alarm``) is decided before the update, on the tokens
  sampled by exactly the trainer's weights (``logprob_mad_on_policy`` and
  ``mismatch_kl_on_policy``, KL(behaviour || proximal) there): past ``alarm.max_on_policy_mad``
  or ``alarm.max_on_policy_mismatch_kl`` (both scaled to ``dtype`` when unset) the step raises ``LogprobAlarm`` (``stop``) or applies no update
  and reports ``skipped=1, alarm=1`` (``skip_step``).
"""

from __future__ import annotations

import contextlib
import math
import time

import numpy as np
import torch
from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from services.trainer.alarm import LogprobAlarm, on_policy_breach
from services.trainer.compile import compile_decoder_layers
from services.trainer.device import compute_precision, resolve_device
from services.trainer.lora import with_lora
from services.trainer.sharding import all_sum, rank_share, shard_policy, world
from services.trainer.batching import masked_copy, micro_batches, prepare_samples
from services.trainer.loss import decoupled_loss, k3, loss_denominator
from services.trainer.losses import aggregation_of
from services.policy.model import frozen_reference, load_policy, sequence_logprobs
from shared.model_source import resolve_model_source
from shared.rates import per_second
from shared.schemas import TrainingBatch
from shared.settings import BatchingSettings, LogprobAlarmSettings, LossSettings, OptimSettings, Settings

QUANTILES = (5, 50, 95)  # the percentiles of the mismatch ratio a step reports


def build_optimizer(model: torch.nn.Module, optim: OptimSettings) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    # torch's fused AdamW (one kernel for every parameter's update) where every parameter is on a GPU
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay,
                             fused=fused or None)


class PolicyTrainer:
    def __init__(
        self,
        model: PreTrainedModel,
        pad_token_id: int,
        optim: OptimSettings | None = None,
        loss: LossSettings | None = None,
        batching: BatchingSettings | None = None,
        reference: PreTrainedModel | None = None,
        temperature: float = 1.0,
        alarm: LogprobAlarmSettings | None = None,
        dtype: str = "fp32",
        logprob_chunk_tokens: int | None = None,
        trim_prompt_logits: bool = True,
    ):
        """``dtype`` bf16: mixed precision, the model's own float32 weights as the master copy
        (``services.trainer.device``). The model's device is where the step computes."""
        self.model = model
        self.dtype = dtype
        self.logprob_chunk_tokens = logprob_chunk_tokens
        self.trim_prompt_logits = trim_prompt_logits
        self.device = next(model.parameters()).device
        self.alarm = (alarm or LogprobAlarmSettings()).scaled_to(dtype)  # as settings do
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 to train on sampled tokens, got {temperature}")
        self.pad_token_id = pad_token_id
        self.temperature = temperature  # the rollout sampling temperature (see policy.py)
        self.optim = optim or OptimSettings()
        self.loss = loss or LossSettings()
        self.batching = batching or BatchingSettings()
        self.base_is_reference = self.loss.kl_coef > 0 and reference is None and isinstance(model, PeftModel)
        if self.loss.kl_coef > 0 and reference is None and not self.base_is_reference:
            reference = frozen_reference(model)
        self.reference = reference if self.loss.kl_coef > 0 else None
        self.optimizer = build_optimizer(model, self.optim)
        self.step = 0

    def train_step(self, batches: list[TrainingBatch]) -> dict[str, float]:
        started = time.perf_counter()
        prepared = prepare_samples([s for b in batches for s in b.samples], self.batching)
        mbs = micro_batches(prepared.samples, self.batching.micro_batch_tokens, self.pad_token_id)
        agg, max_seq_len = aggregation_of(self.loss), self.batching.max_seq_len
        denominator = sum(loss_denominator(mb.loss_mask, agg, max_seq_len) for mb in mbs)
        metrics: dict[str, float] = {
            "sequences": float(len(prepared.samples)), "dropped": float(len(prepared.dropped)),
            "truncated": float(prepared.truncated), "overlong_masked": float(prepared.overlong_masked),
            "micro_batches": float(len(mbs)),
        }
        weighted = {"clip_frac": 0.0, "ratio_mean": 0.0, "kl": 0.0, "logprob_mad_vs_inference": 0.0,
                    "mismatch_kl": 0.0, "correction_masked_frac": 0.0}
        log_weights: list[torch.Tensor] = []  # every masked token's log(proximal / behaviour), for quantiles
        if denominator == 0:  # same keys, so a metrics log has one shape
            return metrics | weighted | mismatch_quantiles(log_weights) | {
                "skipped": 1.0, "alarm": 0.0, "loss": 0.0, "grad_norm": 0.0, "tokens": 0.0, "loss_tokens": 0.0,
                "tokens_per_s": 0.0, "step_time_s": time.perf_counter() - started, "step": float(self.step),
                "logprob_mad_on_policy": math.nan, "mismatch_kl_on_policy": math.nan,
            }

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        tokens: float  # counted in ints; all_sum sums in floats
        total_loss, tokens, loss_tokens = 0.0, 0, 0.0
        on_policy_abs, on_policy_kl, on_policy_tokens = 0.0, 0.0, 0.0
        rank, world_size = world()
        for mb, real in rank_share(mbs, rank, world_size, masked_copy) if world_size > 1 else [(mb, True) for mb in mbs]:
            mb = mb.to(self.device)
            needed = {"needed": mb.loss_mask if self.trim_prompt_logits else None,
                      "chunk_tokens": self.logprob_chunk_tokens}
            with compute_precision(self.device, self.dtype):
                logprobs = sequence_logprobs(self.model, mb.input_ids, mb.attention_mask, self.temperature, **needed)
            # the correctness alarm: on rows sampled by exactly these weights, trainer and
            # inference logprobs must agree (off-policy rows differ by design)
            same = mb.loss_mask * (mb.policy_versions == self.step).unsqueeze(-1)
            log_k = (logprobs.detach() - mb.old_logprobs) * same  # log(proximal / behaviour)
            mb_abs, mb_kl, mb_tokens = torch.stack(  # one transfer from the device
                [log_k.abs().sum(), (k3(log_k) * same).sum(), same.sum()]).tolist()
            on_policy_abs, on_policy_kl, on_policy_tokens = on_policy_abs + mb_abs, on_policy_kl + mb_kl, on_policy_tokens + mb_tokens
            ref = None
            if self.reference is not None or self.base_is_reference:
                adapters_off = self.model.disable_adapter() if self.base_is_reference else contextlib.nullcontext()
                with torch.no_grad(), compute_precision(self.device, self.dtype), adapters_off:
                    ref = sequence_logprobs(self.reference or self.model, mb.input_ids, mb.attention_mask,
                                            self.temperature, **needed)
            result = decoupled_loss(logprobs, mb.old_logprobs, mb.advantages, mb.loss_mask, self.loss,
                                    ref_logprobs=ref, denominator=denominator, max_seq_len=max_seq_len)
            loss, stats = result.loss, result.stats
            log_weights.append(result.log_weights.float())  # on the device: one transfer per step, in mismatch_quantiles
            (loss * world_size).backward()  # FSDP averages gradients over ranks (services.trainer.sharding)
            total_loss += float(loss.detach())
            tokens += mb.tokens if real else 0
            loss_tokens += stats["loss_tokens"]
            for key in weighted:
                weighted[key] += stats[key] * stats["loss_tokens"]

        if world_size > 1:  # every rank reports the whole step
            total_loss, tokens, loss_tokens, on_policy_abs, on_policy_kl, on_policy_tokens, *sums = all_sum(
                [total_loss, tokens, loss_tokens, on_policy_abs, on_policy_kl, on_policy_tokens, *weighted.values()],
                self.device)
            weighted = dict(zip(weighted, sums))
        max_norm = self.optim.max_grad_norm if self.optim.max_grad_norm is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
            grad_norm = grad_norm.full_tensor()
        mad = on_policy_abs / on_policy_tokens if on_policy_tokens else math.nan
        mismatch_kl = on_policy_kl / on_policy_tokens if on_policy_tokens else math.nan
        breach = on_policy_breach(mad, mismatch_kl, self.alarm)  # NaN (no on-policy token) never fires
        alarm = breach is not None
        if breach is not None and self.alarm.action == "stop":
            self.optimizer.zero_grad(set_to_none=True)
            raise LogprobAlarm(breach)
        if alarm:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.step += 1
        elapsed = time.perf_counter() - started
        return metrics | {k: v / loss_tokens for k, v in weighted.items()} | mismatch_quantiles(log_weights) | {
            "skipped": float(alarm), "alarm": float(alarm), "loss": total_loss, "grad_norm": float(grad_norm),
            "tokens": float(tokens), "loss_tokens": loss_tokens, "tokens_per_s": _unknown_as_nan(per_second(tokens, elapsed)),
            "step_time_s": elapsed, "step": float(self.step), "logprob_mad_on_policy": mad,
            "mismatch_kl_on_policy": mismatch_kl,
        }


def mismatch_quantiles(log_weights: list[torch.Tensor]) -> dict[str, float]:
    """The 5th, 50th and 95th percentiles of ``w = proximal / behaviour`` over the step's masked
    tokens (NaN with none). Under FSDP, over this rank's micro-batches only."""
    values = torch.cat(log_weights).cpu().double().exp().numpy() if log_weights else np.empty(0)
    if values.size == 0:
        return {f"mismatch_ratio_p{q:02d}": math.nan for q in QUANTILES}
    return {f"mismatch_ratio_p{q:02d}": float(np.quantile(values, q / 100)) for q in QUANTILES}


def _unknown_as_nan(rate: float | None) -> float:
    """A metric is a number: an unknown rate is NaN there (the sinks write it as null)."""
    return math.nan if rate is None else rate


def trainer_from_settings(settings: Settings, shard: bool = False) -> tuple[PolicyTrainer, PreTrainedTokenizerBase]:
    """The run's policy (``inference.model_path``: a local checkpoint or a Hugging Face model name,
    on ``trainer.device``) and its trainer.
    ``shard``: FSDP2 over the ranks (``services.trainer.sharding``), before the optimizer is built."""
    trainer = settings.trainer
    if trainer.torch_threads:
        torch.set_num_threads(trainer.torch_threads)
    model, tokenizer = load_policy(resolve_model_source(settings.inference.model_path).value, resolve_device(trainer.device))
    if trainer.activation_checkpointing:
        model.gradient_checkpointing_enable()
    if trainer.lora.enabled:  # transformers' checkpointing (non-reentrant) carries grad past the frozen base
        model = with_lora(model, trainer.lora)
    if trainer.compile_layers:
        compile_decoder_layers(model)
    if shard:
        shard_policy(model)
    policy_trainer = PolicyTrainer(
        model, pad_token_id=tokenizer.pad_token_id or 0, optim=trainer.optim, loss=trainer.loss,
        batching=trainer.batching, temperature=settings.rollout.sampling.temperature or 1.0,
        alarm=trainer.logprob_alarm, dtype=trainer.dtype, logprob_chunk_tokens=trainer.logprob_chunk_tokens,
    )
    return policy_trainer, tokenizer


def train_version(trainer: PolicyTrainer, batches: list[TrainingBatch]) -> dict[str, float]:
    """The step of one policy version: a step that applied no update still counts as one, so
    the queue position stays a function of the version (``services.trainer.loop``)."""
    metrics = trainer.train_step(batches)
    if metrics.get("skipped"):
        trainer.step += 1
    return metrics
