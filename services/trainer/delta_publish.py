"""The trainer's side of ``inference.weight_sync: delta``: after each version's S3 checkpoint (the
durable record a resume reads, as on the s3 path), publish the version to the run's delta chain
(``services.weights.delta_chain``) in the served dtype, then announce the chain's prefix.

Invariants:
- The checkpoint of ``v`` is committed before chain version ``v``, and the announcement comes
  after both: a trainer that dies between them resumes from ``v`` and publishes ``v + 1`` as a
  full version (a new writer holds no previous tensors), so the chain never holds a version the
  trainer would publish again.
- A version is announced by its chain prefix when the chain holds it, else by its checkpoint
  prefix (the s3 path serves that one): a resumed trainer re-announces its version either way.
- With ``inference.weight_sync.encode_on: device`` the served tensors stay on the model's device
  and the writer keeps the last version there, so a GPU trainer's ``grouped`` encode compares and
  orders on the GPU (``services.weights.delta_order_device``); the chain's bytes are the same.
- What the chain holds is what vLLM serves, cast to ``inference.dtype``: ``model.state_dict()``,
  or for a LoRA policy (``trainer.lora.sync: merged``) the base weights with the adapters added,
  under the base's names (``services.trainer.lora.merged_state_dict``, as its checkpoint holds).
- After each full version, the chain is pruned of the versions no replica can still need
  (``services.weights.delta_prune``, whose rule reads the run's served version from ``served``).
"""

from __future__ import annotations

from typing import Callable

import torch
from peft import PeftModel

from services.policy.model import served_dtype
from services.trainer.lora import merged_state_dict
from services.weights.delta_chain import ChainWriter, Published
from services.weights.delta_prune import prune_chain
from shared.names import CHECKPOINT_COMMITTED, weight_chain_prefix
from shared.settings import DeltaWeightSync, Settings
from shared.storage import ObjectStore

class DeltaPublisher:
    """Publishes each trained version to the chain; see the invariants."""

    def __init__(self, settings: Settings, store: ObjectStore, served: Callable[[], int]):
        sync = settings.inference.weight_sync
        if not isinstance(sync, DeltaWeightSync):
            raise ValueError(f"the delta publisher needs inference.weight_sync: delta, not {sync.mode}")
        self.dtype = served_dtype(settings.inference.dtype)
        self.last_published: int | None = None
        self.served = served  # the run's served policy version (0: none of the chain's yet)
        self.on_device = sync.encode_on == "device"
        self.writer = ChainWriter(store, settings.run_id, full_every=sync.full_every,
                                  max_fraction=sync.delta_max_fraction, encoding=sync.encoding,
                                  keep_on_device=self.on_device)

    def has(self, version: int) -> bool:
        """Whether chain version ``version`` is committed (the one this publisher last committed is,
        without asking the store)."""
        if version == self.last_published:
            return True
        prefix = weight_chain_prefix(self.writer.run_id, version)
        return prefix + CHECKPOINT_COMMITTED in self.writer.store.list_keys(prefix)

    def publish(self, version: int, model: torch.nn.Module, probe_json: str | None) -> dict[str, float]:
        served = merged_state_dict(model) if isinstance(model, PeftModel) else model.state_dict()
        device = None if self.on_device else "cpu"  # None: stays on the model's device
        tensors = {name: t.detach().to(device, dtype=self.dtype or t.dtype) for name, t in served.items()}
        published: Published = self.writer.publish(version, tensors, probe_json)
        self.last_published = version
        pruned: dict[str, float] = {}
        if published.version.kind == "full":
            done = prune_chain(self.writer.store, self.writer.run_id, self.served())
            pruned = {"delta_pruned_versions": float(len(done.deleted)), "delta_prune_s": done.seconds}
        return pruned | {"delta_full": float(published.version.kind == "full"), "delta_bytes": float(published.version.payload_size),
                "delta_full_size": float(published.full_size), "delta_encode_s": published.encode_s,
                "delta_upload_s": published.upload_s}
