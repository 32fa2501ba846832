"""Weight sync by broadcast (``inference.weight_sync: nccl``): trainer to replicas, no S3 round trip.

The trainer is rank 0 of a process group (``services.weights.process_group``) that every vLLM worker of
every replica joins through Conveyor's worker extension (``conveyor_join_weight_group``). A
sync is ``sync_weights`` (``services.weights.sync``) with the reload replaced by the
broadcast, so it keeps the same discipline:

    pause(mode=keep) -> [collective_rpc conveyor_receive_weights  ||  broadcast each tensor]
                     -> reset_prefix_cache -> [resume -> probe] -> update_weight_version
                     -> [on_served()] -> resume (if no probe)

Invariants (besides those of ``sync_weights``: resume in a ``finally``, the version label and
``on_served`` only after every replica received every tensor and passed the probe):
- Each tensor is sent once, in ``named_tensors`` order, with the names, dtypes and shapes the
  replicas were told beforehand; every replica receives every tensor of a sync or the sync
  fails (``WeightSyncError(phase="reload")``) and the version does not move.
- Tensors travel in buckets (``bucket_layout``, told to the replicas with the names): runs of
  consecutive tensors of one wire dtype flattened into one broadcast of at most ``bucket_bytes``
  (a larger tensor alone), so a sync costs one collective per bucket, not per tensor (the tiny
  model's 21 tensors: 6.5 ms one by one, 1.0 ms as one bucket, on gloo). The trainer holds at
  most one bucket's copy at a time.
- A group in which a broadcast failed is dropped on every side: the next sync rebuilds it
  (every replica rejoins, leaving its old group first).
- The broadcast moves weights only. The durable record stays the S3 checkpoint, which the
  caller writes (asynchronously) after the sync; a replica restarted from it is re-synced by
  the weight follower as before.
- Without CUDA, ``backend="nccl"`` is refused before any replica is touched
  (``services.weights.process_group.check_backend``); ``gloo`` runs the same path on CPU
  (``inference.weight_sync: {mode: nccl, backend: gloo}``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Self

import httpx
import torch

from services.policy.model import served_dtype
from services.weights import sync as ws
from services.weights.process_group import Backend, WeightProcessGroup, check_backend
from shared.settings import NcclWeightSync

log = logging.getLogger(__name__)

JOIN = "conveyor_join_weight_group"
RECEIVE = "conveyor_receive_weights"
LEAVE = "conveyor_leave_weight_group"


_rpc = ws.collective_rpc


BUCKET_BYTES = 256 << 20  # one broadcast carries at most this much (inference.weight_sync.bucket_mib)


def bucket_layout(nbytes: list[int], dtypes: list[torch.dtype], bucket_bytes: int = BUCKET_BYTES
                  ) -> list[list[int]]:
    """The broadcasts of a sync as ``[start, end)`` ranges over the tensors, in order: runs of
    consecutive tensors of one wire dtype, each run cut before it would pass ``bucket_bytes``."""
    buckets: list[list[int]] = []
    size = 0
    for i, (n, dtype) in enumerate(zip(nbytes, dtypes)):
        if buckets and dtype == dtypes[buckets[-1][0]] and size + n <= bucket_bytes:
            buckets[-1][1], size = i + 1, size + n
        else:
            buckets.append([i, i + 1])
            size = n
    return buckets


class WeightBroadcaster:
    """The trainer's end of the broadcast path, for the replicas at ``base_urls``."""

    def __init__(self, base_urls: list[str], *, backend: Backend = "nccl", host: str = "127.0.0.1", port: int,
                 workers_per_replica: int = 1, wire_dtype: torch.dtype | None = None, timeout_s: float = 300.0,
                 device: torch.device | str | None = None, bucket_bytes: int = BUCKET_BYTES):
        check_backend(backend)
        self.urls = [u.rstrip("/") for u in base_urls]
        if not self.urls or len(set(self.urls)) != len(self.urls):
            raise ValueError(f"need distinct replica URLs, got {base_urls!r}")
        self.backend, self.host, self.port = backend, host, port
        self.workers_per_replica, self.wire_dtype, self.timeout_s = workers_per_replica, wire_dtype, timeout_s
        self.device, self.bucket_bytes = device, bucket_bytes
        self.group: WeightProcessGroup | None = None
        self._http = ws.admin_client()

    @classmethod
    def from_settings(cls, settings: Any, **kwargs: Any) -> WeightBroadcaster:
        """Build from ``shared.settings.Settings`` (refused unless ``inference.weight_sync`` is nccl)."""
        inference = settings.inference
        sync = inference.weight_sync
        if not isinstance(sync, NcclWeightSync):
            raise ValueError(f"inference.weight_sync is {sync.mode!r}: the broadcast path is not chosen")
        served = served_dtype(inference.dtype)
        kwargs.setdefault("wire_dtype", served if served in (torch.bfloat16, torch.float16) else None)
        kwargs.setdefault("bucket_bytes", sync.bucket_mib << 20)
        return cls(inference.replica_urls or [inference.base_url], backend=sync.backend, host=sync.host,
                   port=sync.port, workers_per_replica=inference.tensor_parallel_size, **kwargs)

    @property
    def world_size(self) -> int:
        return 1 + len(self.urls) * self.workers_per_replica

    def connect(self) -> None:
        """Build the group: every replica joins (in parallel) while this process opens rank 0."""
        self.drop_group()
        with ThreadPoolExecutor(max_workers=len(self.urls), thread_name_prefix="weight-join") as pool:
            futures = {url: pool.submit(_rpc, self._http, url, JOIN, {
                "backend": self.backend, "host": self.host, "port": self.port,
                "rank_offset": 1 + i * self.workers_per_replica, "world_size": self.world_size,
                "timeout_s": self.timeout_s}, self.timeout_s) for i, url in enumerate(self.urls)}
            try:
                group = WeightProcessGroup(self.backend, self.host, self.port, 0, self.world_size, device=self.device,
                                    timeout_s=self.timeout_s)
            except Exception as exc:
                raise ws.WeightSyncError(f"weight group at {self.host}:{self.port} did not form: {exc}", 0,
                                         {u: str(f.exception()) for u, f in futures.items() if f.exception()},
                                         "connect") from exc
        failed = {u: f.exception() for u, f in futures.items() if f.exception() is not None}
        if failed:
            group.close()
            raise ws.WeightSyncError("replicas could not join the weight group: " + "; ".join(
                f"{u} ({e})" for u, e in failed.items()), 0, {u: str(e) for u, e in failed.items()}, "connect")
        self.group = group
        log.info("weight group (%s) formed at %s:%d with %d replica(s)", self.backend, self.host, self.port,
                 len(self.urls))

    def drop_group(self) -> None:
        """Close this end of the group and ask every replica to leave it (best effort)."""
        if self.group is not None:
            self.group.close()
            self.group = None
            for url in self.urls:
                try:
                    _rpc(self._http, url, LEAVE, {}, 30.0)
                except ws.AdminCallError as exc:
                    log.warning("%s could not leave the weight group: %s", url, exc)

    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *,
             probe: ws.SyncProbe | None = None, on_served: Any = None) -> ws.SyncReport:
        """Serve ``named_tensors`` (checkpoint names, e.g. ``model.named_parameters()``) as ``version``."""
        if self.group is None:
            self.connect()
        tensors = [(name, t.detach()) for name, t in named_tensors]
        return ws.sync_weights(self.urls, None, version, load_all=lambda http, urls: self._send(http, urls, tensors),
                               source=f"{self.backend} broadcast of {len(tensors)} tensors", probe=probe,
                               on_served=on_served, client=self._http)

    def _send(self, http: httpx.Client, urls: list[str], tensors: list[tuple[str, torch.Tensor]]
              ) -> dict[str, BaseException]:
        assert self.group is not None and urls == self.urls
        dtypes = [self.wire_dtype or t.dtype for _, t in tensors]
        buckets = bucket_layout([t.numel() * d.itemsize for (_, t), d in zip(tensors, dtypes)], dtypes,
                                self.bucket_bytes)
        meta = {"names": [n for n, _ in tensors], "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
                "shapes": [list(t.shape) for _, t in tensors], "buckets": buckets}
        send_error: BaseException | None = None
        with ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="weight-receive") as pool:
            futures = {url: pool.submit(_rpc, http, url, RECEIVE, meta, self.timeout_s) for url in urls}
            try:
                for start, end in buckets:
                    parts = [t.to(device=self.group.device, dtype=dtypes[start]).reshape(-1)
                             for _, t in tensors[start:end]]
                    self.group.broadcast(torch.cat(parts) if len(parts) > 1 else parts[0].contiguous())
            except Exception as exc:  # noqa: BLE001 - becomes every replica's failure below
                send_error = exc
        failed: dict[str, BaseException] = {u: failure for u, f in futures.items() if (failure := f.exception()) is not None}
        if send_error is not None:
            failed = {u: failed.get(u, send_error) for u in urls}
        if failed:
            self.group.close()  # a broken collective cannot be resumed: rebuilt at the next sync
            self.group = None
            return failed
        return ws.on_all(urls, lambda url: ws.reset_prefix_cache(http, url))

    def close(self) -> None:
        self.drop_group()
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
