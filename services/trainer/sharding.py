"""Sharded data parallel training with torch's FSDP2 (``fully_shard``): one trainer process per
device, launched with torchrun (``torch.distributed`` already initialised: NCCL on GPUs, gloo
on CPUs).

Invariants:
- Every decoder layer is its own FSDP unit, then the whole model: each rank holds a shard of
  every parameter and of its optimizer state; forward all-gathers a layer's weights, backward
  reduce-scatters its gradients. The decoder layers are the modules whose class the model names
  as not to be split (Hugging Face's ``_no_split_modules``: ``LlamaDecoderLayer``,
  ``GPT2Block``, ...), so every architecture Transformers loads is sharded by its own blocks,
  whatever its attribute path (``model.layers``, ``transformer.h``, ``gpt_neox.layers``).
- Every rank reads the step's whole batch; micro-batch ``i`` runs on rank ``i mod world``. The
  loss is normalised by the whole step's denominator, so summed over ranks it is the
  unsharded step's loss; FSDP averages gradients over ranks, so each rank scales its loss by
  the world size: the update equals the unsharded step's (token-budget micro-batches and
  accumulation are unchanged). A rank with fewer micro-batches runs masked copies (loss 0), so
  every rank joins every collective.
- A LoRA policy (a ``PeftModel``, ``services.trainer.lora``) is wrapped in its adapters first and
  sharded the same way: each adapter is sharded with its decoder layer, and only the adapters
  require gradients, so only they have gradients to reduce and optimizer state to shard.
- Sharded checkpoints are written and read with ``torch.distributed.checkpoint`` (each rank its
  shard, no gather), and hold only the trainable parameters (frozen ones, a LoRA policy's base,
  are the served base checkpoint and never change) and their optimizer state.
  ``full_state_dict`` gathers the whole model, or its trainable parameters only, to rank 0 (the
  other ranks get an empty dict) for the checkpoint vLLM loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from peft import PeftModel
from torch.distributed.fsdp import fully_shard

# frozen parameters (a LoRA policy's base) are left out: they never change
_TRAINABLE = StateDictOptions(ignore_frozen_params=True)


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) when not distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face model (or one in peft adapters), in order: the
    modules of the classes it names in ``_no_split_modules``."""
    inner = model.get_base_model() if isinstance(model, PeftModel) else model
    block_classes = set(getattr(inner, "_no_split_modules", None) or ())
    layers = [module for module in inner.modules() if type(module).__name__ in block_classes]
    if not layers:
        raise ValueError(f"{type(inner).__name__} names no decoder layer class to shard by "
                         f"(_no_split_modules is {getattr(inner, '_no_split_modules', None)!r})")
    return layers


def shard_policy(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 over a Hugging Face causal LM, or one in peft adapters: each decoder layer, then
    the root. In place."""
    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    return model


def rank_share(micro_batches: list[Any], rank: int, world_size: int, masked_copy) -> list[tuple[Any, bool]]:  # noqa: ANN001
    """This rank's micro-batches (``i mod world == rank``) as (micro-batch, real), padded with
    ``masked_copy`` (real False) to the most any rank has, so every rank runs as many passes."""
    mine = [(mb, True) for mb in micro_batches[rank::world_size]]
    most = -(-len(micro_batches) // world_size)
    return mine + [(masked_copy(micro_batches[0]), False)] * (most - len(mine))


def all_sum(values: list[float], device: torch.device) -> list[float]:
    """The sum over ranks of each value (itself when not distributed)."""
    if world()[1] == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    model_state, optim_state = get_state_dict(model, optimizer, options=_TRAINABLE)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory))


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    model_state, optim_state = get_state_dict(model, optimizer, options=_TRAINABLE)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(directory), no_dist=world()[1] == 1)  # one process may read a sharded run
    # dcp.load fails on any requested key the checkpoint lacks, so only frozen ones are missing here
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))


def full_state_dict(model: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's weights (``trainable_only``: its trainable parameters) on rank 0, on
    CPU; an empty dict on the other ranks (``cpu_offload`` with ``full_state_dict``: only rank 0
    holds the gathered copy). Every rank must call it."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                ignore_frozen_params=trainable_only))
