"""The trainer under torchrun: one process (rank) per device, the policy sharded across them
with FSDP2 (``services.trainer.sharding``), and every decision of the run taken once.

Launch: ``torchrun --nproc-per-node N -m services.cli.app trainer -c run.yaml``. Without torchrun
(``WORLD_SIZE`` unset or 1) nothing here runs and the trainer is the one process it always was.

Invariants:
- Rank 0, the leader, is the only rank that talks to Redis: it consumes the trainer stream,
  selects and records each step's groups, commits and announces checkpoints, advances the
  staleness step, logs metrics and runs evaluation. The other ranks, the followers, touch only
  the object store: they read the step's batches and checkpoints and write their own shard
  files. So exactly-once is what it is in one process: every decision is the leader's, taken once.
- The leader sends each step's ``StepOrder`` (the version it makes and its batch keys) with
  ``broadcast_object_list`` after recording the selection and before training; every rank
  trains that step on the same batches (each its share of the micro-batches), so all ranks
  hold the same version. A follower refuses an order that is not for its next version.
- A checkpoint is collective. Every rank writes its shard of model and optimizer state
  (``torch.distributed.checkpoint``) and uploads it to ``trainer_state_sharded/`` under the
  checkpoint's prefix, then the leader gathers every rank's manifest entries and writes the
  Hugging Face checkpoint vLLM loads, from the full state dict gathered to it, and commits.
  ``COMMITTED`` lists every rank's files, so a committed checkpoint holds every shard.
- A LoRA policy trains sharded too (adapters wrapped, then ``fully_shard``; only the adapters
  train). Its shards hold the adapters and their optimizer state; what vLLM serves (merged
  weights or the adapter, ``trainer.lora.sync``) and the trainer state's adapter are written by
  the leader from an unsharded CPU copy of the policy, built once at its first checkpoint (the
  served base again: one more copy of the base in the leader's host memory), with the
  adapters gathered from every rank loaded in: the same ``save_checkpoint`` as one process,
  so the same files.
- Resume is collective: the leader picks the latest committed checkpoint and broadcasts it;
  every rank loads the sharded state from it. A checkpoint without sharded state (written by a
  one-process trainer) is refused at start on every rank. (``checkpoints.resume`` reads a
  sharded checkpoint in one process, so a run can leave torchrun.)
- The leader ends the followers with a stop order when it closes between steps. If a step
  fails on one rank (the logprob alarm stops every rank alike), the ranks are out of step:
  no stop order is sent, and torchrun ends the job.
- Followers wait for the next order without a deadline (``ORDER_TIMEOUT``): the leader may
  wait hours for rollouts. A dead rank does not leave them hanging: torchrun stops every rank
  when one exits with an error.
- A rank process ends with ``exit_rank_process``, which skips the interpreter's shutdown. The
  gloo backend's worker threads outlive ``destroy_process_group`` while anything still refers
  to the group (FSDP2's device mesh does, through the model), and one that drops a finished
  collective's tensors while the interpreter shuts down aborts the process (SIGABRT,
  "terminate called without an active exception"): a rank that did its work then died.
- Not supported under torchrun yet, refused at start: ``inference.weight_sync: nccl`` and a KL
  reference (``trainer.loss.kl_coef > 0``).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn, cast

import torch
import torch.distributed as dist
from peft import PeftModel
from transformers import PreTrainedTokenizerBase

from services.trainer.checkpoints import (SHARDED_STATE, TRAINER_STATE, Snapshot, check_lora_kind,
                                          download_checkpoint, is_committed, latest_checkpoint, save_checkpoint,
                                          sharded_state_files, upload_file)
from services.trainer.device import resolve_device
from services.trainer.lora import load_trainable_weights, with_lora
from services.policy.model import load_policy, logprob_probe
from services.trainer.sharding import full_state_dict, load_sharded, save_sharded
from services.trainer.step import PolicyTrainer, train_version, trainer_from_settings
from services.weights.checkpoint_files import CheckpointError
from shared.names import checkpoint_prefix
from shared.required import required
from shared.schemas import TrainingBatch
from shared.settings import LoraSettings, Settings
from shared.storage import ObjectStore, get_model

log = logging.getLogger(__name__)
ORDER_TIMEOUT = timedelta(days=7)  # the group's timeout: how long a follower waits for the leader


@dataclass(frozen=True)
class StepOrder:
    """What the leader tells every rank to do next (pickled between ranks of one job)."""

    version: int = 0  # the version the step makes
    keys: tuple[str, ...] = ()  # its training batches in the object store
    stop: bool = False


def unsupported(settings: Settings) -> list[str]:
    """The settings a sharded trainer does not support yet."""
    return [reason for reason, on in [
        ("inference.weight_sync: nccl", settings.inference.weight_sync.mode == "nccl"),
        ("inference.weight_sync: delta", settings.inference.weight_sync.mode == "delta"),
        ("trainer.loss.kl_coef > 0", settings.trainer.loss.kl_coef > 0),
    ] if on]


@dataclass
class TrainerRanks:
    """This process's place among the trainer's ranks, and the collectives they take together."""

    rank: int
    world_size: int
    lora: LoraSettings | None = None  # trainer.lora when enabled
    base_path: str | Path | None = None  # inference.model_path: a LoRA policy's base
    in_step: bool = field(default=False, init=False)  # an order was sent and its checkpoint not yet written
    _unsharded_lora: PeftModel | None = field(default=None, init=False)  # the leader's copy (module docstring)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def _broadcast(self, value: object) -> Any:  # the leader's value, whatever this rank passed
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def send(self, order: StepOrder) -> None:
        """The leader: every rank trains this step next."""
        self._broadcast(order)
        self.in_step = not order.stop

    def receive(self) -> StepOrder:
        """A follower: the leader's next order (waits for it)."""
        return self._broadcast(None)

    def stop(self) -> None:
        """The leader, closing: the followers return. Not sent from the middle of a step."""
        if self.in_step:
            log.error("trainer leader closed in the middle of a step: no stop order; torchrun ends the job")
            return
        self.send(StepOrder(stop=True))

    def leave(self) -> None:
        dist.destroy_process_group()

    def resume(self, store: ObjectStore, run_id: str, trainer: PolicyTrainer) -> tuple[int, int]:
        """Every rank: load the latest committed checkpoint's sharded state; (version, step)."""
        latest = self._broadcast(latest_checkpoint(store, run_id) if self.leader else None)
        if latest is None:
            return 0, 0
        version, prefix = latest
        names = sharded_state_files(store, prefix)
        if not names:
            raise CheckpointError(f"{prefix} has no sharded trainer state (a one-process trainer wrote it): "
                                  f"resume it without torchrun")
        with tempfile.TemporaryDirectory(prefix=f"conveyor-resume-rank{self.rank}-") as tmp:
            local = download_checkpoint(store, prefix, Path(tmp) / "checkpoint", with_trainer_state=True,
                                        only=names | {TRAINER_STATE})
            state = torch.load(local / TRAINER_STATE, map_location="cpu", weights_only=True)
            if state.get("version") != version:
                raise CheckpointError(f"{prefix}{TRAINER_STATE} is for version {state.get('version')}, not {version}")
            check_lora_kind(prefix, state, trainer.model)
            load_sharded(trainer.model, trainer.optimizer, local / SHARDED_STATE)
        return version, int(state["step"])

    def save_checkpoint(self, store: ObjectStore, run_id: str, version: int, trainer: PolicyTrainer,
                        tokenizer: PreTrainedTokenizerBase, dataset_versions: list[str]) -> None:
        """Every rank: upload its shard; the leader then writes the served checkpoint and commits
        (``dataset_versions`` is read on the leader only)."""
        prefix = checkpoint_prefix(run_id, version)
        if is_committed(store, prefix):
            raise CheckpointError(f"checkpoint {prefix} is already committed; versions are never overwritten")
        lora = isinstance(trainer.model, PeftModel)
        if lora:
            self._gather_adapters(trainer.model)
        else:
            probe = logprob_probe(trainer.model, version)  # a forward pass: every rank joins it
            weights = full_state_dict(trainer.model)  # the whole model on the leader, nothing elsewhere
        with tempfile.TemporaryDirectory(prefix=f"conveyor-shard-rank{self.rank}-") as tmp:
            save_sharded(trainer.model, trainer.optimizer, Path(tmp))
            mine = {f"{SHARDED_STATE}/{path.name}": upload_file(store, f"{prefix}{SHARDED_STATE}/", path)
                    for path in sorted(Path(tmp).iterdir()) if path.is_file()}
        every: list[dict] | None = [{} for _ in range(self.world_size)] if self.leader else None
        dist.gather_object(mine, every, dst=0)  # after this every rank's shard is in the store
        if self.leader:
            shards = {name: entry for files in cast(list[dict], every) for name, entry in files.items()}  # the leader's list
            if lora:  # the unsharded copy gives the probe and what is served
                save_checkpoint(store, run_id, version, self._unsharded_lora, tokenizer, trainer.optimizer,
                                trainer.step, dataset_versions=dataset_versions,
                                lora_sync=required(self.lora, "TrainerRanks.lora (a LoRA policy has it)").sync,
                                sharded_files=shards)
            else:
                save_checkpoint(store, run_id, version, trainer.model, tokenizer, trainer.optimizer, trainer.step,
                                dataset_versions=dataset_versions, snapshot=Snapshot(version, weights, {}, probe),
                                sharded_files=shards)
        self.in_step = False

    def _gather_adapters(self, model: PeftModel) -> None:
        """Every rank: gather the adapters to the leader, which loads them into its unsharded copy
        of the policy (built at the first call)."""
        adapters = full_state_dict(model, trainable_only=True)  # a collective; {} off the leader
        if self.leader:
            if self._unsharded_lora is None:
                if self.lora is None or self.base_path is None:
                    raise ValueError("a sharded LoRA policy needs TrainerRanks.lora and base_path to checkpoint")
                self._unsharded_lora = with_lora(load_policy(self.base_path)[0], self.lora)
            load_trainable_weights(self._unsharded_lora, adapters)


def exit_rank_process(code: int = 0) -> NoReturn:
    """End this rank's process now, its output flushed and its process group left (module
    docstring: the interpreter's shutdown is where gloo's threads abort it)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def join_from_env(settings: Settings) -> TrainerRanks | None:
    """Join the torchrun job this process is a rank of (gloo on CPU, NCCL on GPU, by
    ``trainer.device``); None when there is none (``WORLD_SIZE`` unset or 1)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return None
    refused = unsupported(settings)
    if refused:
        raise ValueError(f"the sharded trainer (torchrun, WORLD_SIZE={world_size}) does not support "
                         f"{', '.join(refused)} yet; run one trainer process")
    device = resolve_device(settings.trainer.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=ORDER_TIMEOUT)
    lora = settings.trainer.lora
    return TrainerRanks(dist.get_rank(), dist.get_world_size(), lora=lora if lora.enabled else None,
                        base_path=settings.inference.model_path)


def follow(settings: Settings, store: ObjectStore, ranks: TrainerRanks) -> int:
    """A follower rank's whole life: train every step the leader orders, write its shard of
    every checkpoint, until the stop order. Returns the version it reached."""
    trainer, tokenizer = trainer_from_settings(settings, shard=True)
    version, trainer.step = ranks.resume(store, settings.run_id, trainer)
    log.info("trainer rank %d of %d following from version %d", ranks.rank, ranks.world_size, version)
    while not (order := ranks.receive()).stop:
        if order.version != version + 1:
            raise RuntimeError(f"rank {ranks.rank} at version {version} was ordered to make version {order.version}")
        train_version(trainer, [get_model(store, key, TrainingBatch) for key in order.keys])
        ranks.save_checkpoint(store, settings.run_id, order.version, trainer, tokenizer, dataset_versions=[])
        version = order.version
    return version
