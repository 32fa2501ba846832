"""Object storage for trajectories, scored trajectories and training batches.

Two backends behind one interface: S3 (MinIO, or any S3-compatible server, through the
``minio`` SDK) and a local directory (a shared volume, the no-Docker demo, benchmarks).

Invariants:
- Objects are gzip-compressed JSON of a pydantic model; keys come from ``shared.names``.
- ``put`` is idempotent for a key: a retried or redelivered writer overwrites with the same
  content, never creates a second object.
- Transient S3 errors are retried a bounded number of times, then raised as ``StorageError``
  naming the key.
"""

from __future__ import annotations

import gzip
import io
import os
import tempfile
from pathlib import Path
from typing import Protocol, TypeVar

from pydantic import BaseModel
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

from shared.settings import StorageSettings

M = TypeVar("M", bound=BaseModel)


class StorageError(RuntimeError):
    pass


class ObjectStore(Protocol):
    def put_bytes(self, key: str, data: bytes) -> None: ...
    def get_bytes(self, key: str) -> bytes: ...
    def list_keys(self, prefix: str) -> list[str]: ...


def put_model(store: ObjectStore, key: str, model: BaseModel) -> int:
    """Store a model as gzip JSON; returns the compressed size in bytes."""
    data = gzip.compress(model.model_dump_json().encode(), compresslevel=5)
    store.put_bytes(key, data)
    return len(data)


def get_model(store: ObjectStore, key: str, model_type: type[M]) -> M:
    return model_type.model_validate_json(gzip.decompress(store.get_bytes(key)))


class LocalStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root.resolve() not in path.parents:
            raise StorageError(f"object key {key!r} escapes the store root")
        return path

    def put_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as tmp:
            tmp.write(data)
        os.replace(tmp.name, path)  # atomic: readers never see half an object

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise StorageError(f"object {key!r} not found in {self.root}") from None

    def list_keys(self, prefix: str) -> list[str]:
        base = self.root
        return sorted(
            str(p.relative_to(base)) for p in base.rglob("*") if p.is_file() and str(p.relative_to(base)).startswith(prefix)
        )


_transient = retry(
    retry=retry_if_exception_type((ConnectionError, OSError)),
    stop=stop_after_attempt(4),
    wait=wait_exponential(multiplier=0.2, max=2),
    reraise=True,
)


class S3Store:
    def __init__(self, settings: StorageSettings):
        from minio import Minio
        from minio.error import S3Error

        self._s3error = S3Error
        self.bucket = settings.bucket
        self.client = Minio(
            settings.endpoint,
            access_key=settings.access_key,
            secret_key=settings.secret_key,
            secure=settings.secure,
            region=settings.region,
        )

    def ensure_bucket(self) -> None:
        if not self.client.bucket_exists(self.bucket):
            self.client.make_bucket(self.bucket)

    @_transient
    def put_bytes(self, key: str, data: bytes) -> None:
        try:
            self.client.put_object(self.bucket, key, io.BytesIO(data), len(data), content_type="application/gzip")
        except self._s3error as exc:
            raise StorageError(f"S3 put {self.bucket}/{key} failed: {exc}") from exc

    @_transient
    def get_bytes(self, key: str) -> bytes:
        try:
            response = self.client.get_object(self.bucket, key)
        except self._s3error as exc:
            raise StorageError(f"S3 get {self.bucket}/{key} failed: {exc.code}") from exc
        try:
            return response.read()
        finally:
            response.close()
            response.release_conn()

    def list_keys(self, prefix: str) -> list[str]:
        return sorted(o.object_name for o in self.client.list_objects(self.bucket, prefix=prefix, recursive=True))


def open_store(settings: StorageSettings) -> ObjectStore:
    if settings.backend == "local":
        return LocalStore(settings.local_root)
    store = S3Store(settings)
    store.ensure_bucket()
    return store
