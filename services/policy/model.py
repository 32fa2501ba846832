"""The policy as the trainer sees it: the Hugging Face checkpoint vLLM serves, and token logprobs.

Invariants:
- The trainer loads exactly the directory vLLM serves (``inference.model_path``), in float32,
  so trainer and inference logprobs of the same weights agree (the correctness alarm
  ``logprob_mad_vs_inference`` watches this).
- ``sequence_logprobs(...)[b, t]`` is log p(input_ids[b, t] | input_ids[b, :t]) under the
  model, from the logits divided by ``temperature``. Position 0 has no prefix: it is 0, and it is
  always a prompt token, never in a loss mask. Padding (``attention_mask = 0``) is 0 too.
- The inference server returns *processed* logprobs (``--logprobs-mode processed_logprobs``):
  those of the sampling distribution, after temperature. So the trainer must use the rollout
  sampling temperature here, or on-policy ratios are not 1. (top_p < 1 truncates that
  distribution too; it is not replicated here, and ``logprob_mad_vs_inference`` would show it.)
- Sequences are right-padded, so the positions of real tokens are 0..len-1 as at inference.
- ``sequence_logprobs(..., needed=mask, chunk_tokens=n)`` gives the same value at every
  position from the first one the mask needs in any row (0 before it); it only computes less
  (the output head from that position on) and holds less (one chunk of float32 logits at a time).
- The policy runs without dropout: ``load_policy`` zeroes every dropout module and dropout
  rate of the model (GPT-2's configs ask for 0.1, for instance). vLLM samples without dropout,
  so with it the trainer's logprobs of the same weights would be noisy, on-policy ratios would
  not be 1, and the updates would follow the noise. The checkpoint's config is not changed.
- The frozen reference is a copy of the initial policy with gradients off, in eval mode.
- ``logprob_probe(model, version)`` is the probe every checkpoint carries
  (``services.policy.probe``): temperature 1, eval mode, no gradient, and the model's
  train/eval mode is left as it was.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from services.policy.probe import LogprobProbe, probe_token_ids
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)


def load_policy(model_dir: str | Path, device: str | torch.device = "cpu") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model (float32, training mode, no KV cache) and tokenizer from a HF checkpoint dir."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
    without_dropout(model)
    model.config.use_cache = False
    model.train()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return model, tokenizer


def without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Zero every dropout module's rate, and every float attribute named for a dropout rate
    (attention modules keep theirs as a float, e.g. ``attention_dropout``). In place."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in vars(module).items():
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    return model


def frozen_reference(model: PreTrainedModel) -> PreTrainedModel:
    """A frozen copy of ``model`` as it is now (call before the first update)."""
    reference = copy.deepcopy(model)
    reference.eval()
    reference.requires_grad_(False)
    return reference


def sequence_logprobs(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0,
    *, needed: torch.Tensor | None = None, chunk_tokens: int | None = None,
) -> torch.Tensor:
    """``[B, T]`` logprob of each token given its prefix; 0 at position 0 and on padding.

    ``needed`` (``[B, T]``, e.g. the loss mask): logits are computed only from the first position
    any row needs (the model's ``logits_to_keep``: the output head and the float32 softmax skip
    the shared prompt); earlier positions are 0. ``chunk_tokens``: the float32 log-softmax runs
    over that many positions at a time, recomputed in backward, so only one chunk's float32
    logits live at once. Every position computed has the same value either way."""
    first = _first_needed(needed, input_ids.shape[1])
    keep = input_ids.shape[1] - first + 1  # logits at first - 1 .. T - 1 predict tokens first .. T
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                   **({"logits_to_keep": keep} if first > 1 else {})).logits
    logits = logits[:, :-1]
    targets = input_ids[:, first:]
    shifted = _chunked_token_logprobs(logits, targets, temperature, chunk_tokens)
    shifted = shifted * attention_mask[:, first:].to(shifted.dtype)
    return torch.cat([shifted.new_zeros(shifted.shape[0], first), shifted], dim=1)


def _first_needed(needed: torch.Tensor | None, length: int) -> int:
    """The first position any row needs (at least 1: position 0 has no logprob)."""
    if needed is None:
        return 1
    columns = needed.bool().any(dim=0).nonzero()
    return max(1, int(columns[0])) if len(columns) else length  # none needed: no logits at all but the last


def _token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # logsumexp in at least float32
    if temperature != 1.0:
        logits = logits / temperature
    token_logits = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    return token_logits - torch.logsumexp(logits, dim=-1)


def _chunked_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                            chunk_tokens: int | None) -> torch.Tensor:
    """``_token_logprobs`` over ``[B, K, V]`` logits, ``chunk_tokens`` positions at a time."""
    if chunk_tokens is None or logits.shape[0] * logits.shape[1] <= chunk_tokens:
        return _token_logprobs(logits, targets, temperature)
    rows, positions, vocab = logits.shape
    flat, flat_targets = logits.reshape(rows * positions, vocab), targets.reshape(rows * positions)
    parts = []
    for start in range(0, rows * positions, chunk_tokens):
        chunk = (flat[start:start + chunk_tokens], flat_targets[start:start + chunk_tokens], temperature)
        parts.append(checkpoint(_token_logprobs, *chunk, use_reentrant=False) if torch.is_grad_enabled()
                     else _token_logprobs(*chunk))
    return torch.cat(parts).view(rows, positions)


SERVED_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
                 "auto": None}


def served_dtype(dtype: str) -> torch.dtype | None:
    """The torch dtype vLLM serves for ``inference.dtype`` (None: the model's own, for ``auto``)."""
    if dtype not in SERVED_DTYPES:
        raise ValueError(f"inference.dtype {dtype!r} names no dtype; use one of {', '.join(SERVED_DTYPES)}")
    return SERVED_DTYPES[dtype]


@torch.no_grad()
def logprob_probe(model: PreTrainedModel, version: int) -> LogprobProbe:
    """The model's logprobs of the fixed probe sequence, for the checkpoint of ``version``."""
    token_ids = probe_token_ids(model.config.vocab_size)
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        ids = torch.tensor([token_ids], device=device)
        logprobs = sequence_logprobs(model, ids, torch.ones_like(ids), temperature=1.0)[0, 1:]
    finally:
        model.train(was_training)
    return LogprobProbe(version=version, token_ids=token_ids, logprobs=[float(x) for x in logprobs.double().cpu()])
