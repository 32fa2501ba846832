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
- What the chain holds is ``model.state_dict()`` cast to ``inference.dtype``: what vLLM serves.
"""

from __future__ import annotations

import torch

from services.weights.delta_chain import ChainWriter, Published
from shared.names import CHECKPOINT_COMMITTED, weight_chain_prefix
from shared.settings import DeltaWeightSync, Settings
from shared.storage import ObjectStore

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16, "auto": None}


def served_dtype(dtype: str) -> torch.dtype | None:
    """The torch dtype of ``inference.dtype`` (None: the model's own, for ``auto``)."""
    if dtype not in _DTYPES:
        raise ValueError(f"inference.dtype {dtype!r} has no served dtype for the delta chain; use one of "
                         f"{', '.join(_DTYPES)}")
    return _DTYPES[dtype]


class DeltaPublisher:
    """Publishes each trained version to the chain; see the invariants."""

    def __init__(self, settings: Settings, store: ObjectStore):
        sync = settings.inference.weight_sync
        if not isinstance(sync, DeltaWeightSync):
            raise ValueError(f"the delta publisher needs inference.weight_sync: delta, not {sync.mode}")
        self.dtype = served_dtype(settings.inference.dtype)
        self.writer = ChainWriter(store, settings.run_id, full_every=sync.full_every,
                                  max_fraction=sync.delta_max_fraction, encoding=sync.encoding)

    def has(self, version: int) -> bool:
        """Whether chain version ``version`` is committed."""
        prefix = weight_chain_prefix(self.writer.run_id, version)
        return prefix + CHECKPOINT_COMMITTED in self.writer.store.list_keys(prefix)

    def publish(self, version: int, model: torch.nn.Module, probe_json: str | None) -> dict[str, float]:
        tensors = {name: t.detach().to("cpu", dtype=self.dtype or t.dtype) for name, t in model.state_dict().items()}
        published: Published = self.writer.publish(version, tensors, probe_json)
        return {"delta_full": float(published.version.kind == "full"), "delta_bytes": float(published.version.payload_size),
                "delta_full_size": float(published.full_size), "delta_encode_s": published.encode_s,
                "delta_upload_s": published.upload_s}
