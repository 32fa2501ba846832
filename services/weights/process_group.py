"""The process group a trainer broadcasts weights through to the vLLM replicas.

One group per trainer: rank 0 is the trainer (it hosts the rendezvous ``TCPStore``), ranks
1..N are the replicas' vLLM workers (each joins through Conveyor's worker extension,
``services.inference.vllm_worker``). ``nccl`` moves CUDA tensors GPU to GPU; ``gloo`` moves
CPU tensors and runs the same code on a machine without a GPU (the tests use it).

Invariants:
- The group is built from torch's own process-group classes on a private store, never with
  ``torch.distributed.init_process_group``: it does not touch the default group that vLLM's
  workers (or an FSDP trainer) already use.
- Every rank of a group must construct it at the same time (the constructor is a
  rendezvous); ``timeout_s`` bounds how long one waits for the others.
- ``broadcast`` is collective: every rank calls it with a tensor of the same shape and dtype,
  in the same order; rank 0's values end up in every rank's tensor.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

Backend = Literal["nccl", "gloo"]
BACKENDS = ("nccl", "gloo")


class WeightProcessGroupError(RuntimeError):
    pass


def check_backend(backend: str) -> None:
    """Raise ``WeightProcessGroupError`` unless ``backend`` can run in this process."""
    if backend not in BACKENDS:
        raise WeightProcessGroupError(f"weight-sync process group backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise WeightProcessGroupError("the nccl weight-sync path needs CUDA, and torch sees no GPU in this process "
                               "(set inference.weight_sync: s3, or its backend: gloo, on hosts without GPUs)")


class WeightProcessGroup:
    """Rank ``rank`` of a ``world_size`` group at ``host:port`` (rank 0 hosts the store)."""

    def __init__(self, backend: Backend, host: str, port: int, rank: int, world_size: int, *,
                 device: torch.device | str | None = None, timeout_s: float = 300.0):
        check_backend(backend)
        if not 0 <= rank < world_size or world_size < 2:
            raise WeightProcessGroupError(f"rank {rank} of a weight group of {world_size}: need 0 <= rank < world_size, "
                                   "and at least one replica besides the trainer")
        self.backend, self.rank, self.world_size = backend, rank, world_size
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu"))
        timeout = timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout,
                                    wait_for_workers=False)
        prefixed = dist.PrefixStore("conveyor-weights", self._store)
        if backend == "gloo":
            self._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        self._barrier()  # every rank is connected before anyone sends

    def _barrier(self) -> None:
        flag = torch.zeros(1, device=self.device)
        self._pg.allreduce([flag]).wait()

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Broadcast ``tensor`` from rank 0 in place (on this group's device); returns it."""
        if tensor.device != self.device:
            raise WeightProcessGroupError(f"tensor on {tensor.device}, group on {self.device}")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._pg.broadcast([tensor], opts).wait()
        return tensor

    def close(self) -> None:
        pg, self._pg = getattr(self, "_pg", None), None
        if pg is not None and hasattr(pg, "shutdown"):
            pg.shutdown()
