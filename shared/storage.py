"""Object storage for trajectories, scored trajectories and training batches.

Two backends behind one interface: S3 (MinIO, or any S3-compatible server, through the
``minio`` SDK) and a local directory (a shared volume, the no-Docker demo, benchmarks).

Invariants:
- Objects are gzip-compressed JSON of a pydantic model, or bundles of many
  (``shared.object_bundles``); keys come from ``shared.names``. ``get_model`` reads a bundle
  member's ref as it reads a key.
- ``put`` is idempotent for a key: a retried or redelivered writer overwrites with the same
  content, never creates a second object.
- An S3 server that is down (refused or dropped connections, timeouts, 5xx answers) is waited
  out by every call, the bucket check included (``shared.outage``: bounded backoff, logged once
  per outage and then periodically); past ``outage.limit_s`` the call raises
  ``OutageTooLong``. An outage is never a ``StorageError``: callers fail work on a
  ``StorageError`` (a missing object, a refused bucket or request), never on an outage.
- A fault of the storage itself (a full or read-only disk, a directory made unavailable, a
  vanished mount, an I/O error; an S3 server answering 5xx, ``SlowDown`` or "storage full";
  ``shared.storage_faults`` lists them) is an outage of the store too, waited out the same way,
  for both backends: one line when it starts, one when it ends.
- A local write goes to a hidden temporary file in the object's folder, then is renamed over the
  key: a reader sees the whole object or none, a failed write leaves no temporary file behind
  (removed, or hidden from ``list_keys`` if even that fails). The store's root holds a marker
  file from its first open: a root without it (a vanished or unmounted volume) is a fault, and
  is never filled again on the disk beneath the mount point.
- ``delete_keys`` removes the objects it names, in order; a key that is not there is no error
  (a retried delete). Only a store's owner of that prefix deletes (the delta chain's pruning).
- ``open_store`` checks the S3 server at once: refusing the bucket is a ``StorageError`` naming
  the endpoint.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import io
import os
import tempfile
from pathlib import Path
from typing import Callable, Protocol, Sequence, TypeVar

from pydantic import BaseModel
from shared.object_bundles import cache_of, decode_bundle, encode_bundle, is_bundle_key, member_ref, split_ref
from shared.outage import Dependency
from shared.settings import LocalStorageSettings, OutageSettings, S3StorageSettings, StorageSettings
from shared.storage_faults import S3_FAULT_CODES, StoreRootMissing, local_fault, s3_fault_status

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class StorageError(RuntimeError):
    pass


class ObjectStore(Protocol):
    def put_bytes(self, key: str, data: bytes, content_type: str = "application/gzip") -> None: ...
    def get_bytes(self, key: str) -> bytes: ...
    def list_keys(self, prefix: str) -> list[str]: ...
    def delete_keys(self, keys: Sequence[str]) -> None: ...


def put_model(store: ObjectStore, key: str, model: BaseModel) -> int:
    """Store a model as gzip JSON; returns the compressed size in bytes."""
    data = gzip.compress(model.model_dump_json().encode(), compresslevel=5)
    store.put_bytes(key, data)
    return len(data)


def put_bundle(store: ObjectStore, bundle_key: str, models: Sequence[BaseModel]) -> list[str]:
    """Store models as one bundle (``shared.object_bundles``); returns their refs, in order."""
    refs = [member_ref(bundle_key, index) for index in range(len(models))]  # refuses a key that is not a bundle's
    store.put_bytes(bundle_key, encode_bundle(models))
    return refs


def get_model(store: ObjectStore, key: str, model_type: type[M]) -> M:
    """The model at an object key, or the bundle member a ref names (its bundle read once for
    the process's next reads of its members: ``shared.object_bundles.BundleCache``)."""
    ref = split_ref(key)
    if ref is None:
        return model_type.model_validate_json(gzip.decompress(store.get_bytes(key)))
    bundle_key, index = ref
    try:
        members = cache_of(store).members(bundle_key, lambda: store.get_bytes(bundle_key))
    except StorageError as exc:
        raise StorageError(f"bundle member {key!r}: {exc}") from exc
    if index >= len(members):
        raise StorageError(f"bundle member {key!r} does not exist: bundle {bundle_key!r} holds {len(members)} members")
    return model_type.model_validate_json(members[index])


def get_models_under(store: ObjectStore, prefix: str, model_type: type[M]) -> list[M]:
    """Every model stored under ``prefix``: a plain object's, and each member of a bundle."""
    models: list[M] = []
    for key in store.list_keys(prefix):
        if is_bundle_key(key):
            models += [model_type.model_validate_json(m) for m in decode_bundle(store.get_bytes(key))]
        else:
            models.append(get_model(store, key, model_type))
    return models


class LocalStore:
    """Objects as files under ``root`` (a shared volume); every call waits out a fault of the
    disk or the mount (``shared.storage_faults``)."""

    _TMP_PREFIX = ".tmp-"  # hidden from list_keys: never read as an object
    MARKER = ".conveyor-store"  # written at the first open: a root without it is an unmounted volume

    def __init__(self, root: Path, outage: OutageSettings | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._resolved_root = self.root.resolve()
        self._marker = self.root / self.MARKER
        self.dependency = Dependency.named(f"object store at {self.root}", outage or OutageSettings())
        if not self._marker.exists():
            self._call(lambda: self._marker.write_bytes(b"conveyor object store\n"))

    def _call(self, fn: Callable[[], T]) -> T:
        return self.dependency.call(fn, local_fault)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self._resolved_root not in path.parents:
            raise StorageError(f"object key {key!r} escapes the store root")
        return path

    def _require_root(self) -> None:
        if not self._marker.exists():  # the folder gone, or an empty mount point left behind
            raise StoreRootMissing(self.root)

    def put_bytes(self, key: str, data: bytes, content_type: str = "application/gzip") -> None:
        path = self._path(key)  # a file has no content type: the key's suffix says it
        self._call(lambda: self._write(path, data))

    def _write(self, path: Path, data: bytes) -> None:
        self._require_root()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.NamedTemporaryFile(dir=path.parent, prefix=self._TMP_PREFIX, delete=False)
        try:
            with tmp:
                tmp.write(data)
            os.replace(tmp.name, path)  # atomic: readers never see half an object
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp.name)
            raise

    def get_bytes(self, key: str) -> bytes:
        path = self._path(key)
        return self._call(lambda: self._read(key, path))

    def _read(self, key: str, path: Path) -> bytes:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            self._require_root()  # a vanished mount is a fault, not a missing object
            raise StorageError(f"object {key!r} not found in {self.root}") from None

    def list_keys(self, prefix: str) -> list[str]:
        return self._call(lambda: self._list(prefix))

    def _list(self, prefix: str) -> list[str]:
        self._require_root()
        base = self.root
        start = base / prefix.rsplit("/", 1)[0] if "/" in prefix else base  # only the prefix's folder is walked
        if not start.is_dir():
            return []
        return sorted(
            key for p in start.rglob("*")
            if p.is_file() and not p.name.startswith(".") and (key := str(p.relative_to(base))).startswith(prefix)
        )


    def delete_keys(self, keys: Sequence[str]) -> None:
        for path in [self._path(key) for key in keys]:
            self._call(functools.partial(self._unlink, path))

    def _unlink(self, path: Path) -> None:
        self._require_root()
        path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # the object's folder, once empty
            path.parent.rmdir()


class S3Store:
    def __init__(self, settings: S3StorageSettings, outage: OutageSettings | None = None):
        import urllib3
        from minio import Minio
        from minio.error import S3Error, ServerError

        self._s3error = S3Error
        self._transient_types = (urllib3.exceptions.HTTPError, OSError, ServerError)
        self.bucket = settings.bucket
        self.endpoint = settings.endpoint
        self.dependency = Dependency.named(f"S3 server at {settings.endpoint}", outage or OutageSettings())
        self.client = Minio(
            settings.endpoint,
            access_key=settings.access_key,
            secret_key=settings.secret_key,
            secure=settings.secure,
            region=settings.region,
            # few quick retries of its own (the outage helper waits longer), and timeouts, so a
            # frozen server is an outage too instead of a five-minute hang per call
            http_client=urllib3.PoolManager(
                timeout=urllib3.Timeout(connect=5, read=60), maxsize=16,
                cert_reqs="CERT_REQUIRED" if settings.secure else "CERT_NONE",
                ca_certs=os.environ.get("SSL_CERT_FILE") or _certifi_bundle(),
                retries=urllib3.Retry(total=2, backoff_factor=0.1, status_forcelist=[500, 502, 503, 504]),
            ),
        )

    def _transient(self, exc: BaseException) -> bool:
        if isinstance(exc, self._s3error):
            return exc.code in S3_FAULT_CODES or s3_fault_status(getattr(exc.response, "status", None))
        return isinstance(exc, self._transient_types)

    def _call(self, fn: Callable[[], T]) -> T:
        return self.dependency.call(fn, self._transient)

    def ensure_bucket(self) -> None:
        def ensure() -> None:
            if not self.client.bucket_exists(self.bucket):
                self.client.make_bucket(self.bucket)

        try:
            self._call(ensure)
        except self._s3error as exc:
            raise StorageError(f"S3 server at {self.endpoint} refused bucket {self.bucket!r}: {exc.code}: {exc.message}") from exc

    def put_bytes(self, key: str, data: bytes, content_type: str = "application/gzip") -> None:
        try:
            self._call(lambda: self.client.put_object(self.bucket, key, io.BytesIO(data), len(data), content_type=content_type))
        except self._s3error as exc:
            raise StorageError(f"S3 put {self.bucket}/{key} failed: {exc}") from exc

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._call(lambda: self._read(key))
        except self._s3error as exc:
            raise StorageError(f"S3 get {self.bucket}/{key} failed: {exc.code}") from exc

    def _read(self, key: str) -> bytes:
        response = self.client.get_object(self.bucket, key)
        try:
            return response.read()
        finally:
            response.close()
            response.release_conn()

    def list_keys(self, prefix: str) -> list[str]:
        return self._call(lambda: sorted(o.object_name for o in self.client.list_objects(self.bucket, prefix=prefix, recursive=True)))


    def delete_keys(self, keys: Sequence[str]) -> None:
        for key in keys:  # one at a time, in order: a reader never sees a later key gone before an earlier one
            try:
                self._call(functools.partial(self.client.remove_object, self.bucket, key))
            except self._s3error as exc:
                raise StorageError(f"S3 delete {self.bucket}/{key} failed: {exc.code}") from exc


def _certifi_bundle() -> str:
    import certifi

    return certifi.where()


def open_store(settings: StorageSettings, outage: OutageSettings | None = None) -> ObjectStore:
    """The configured store; an S3 server is checked at once (waiting out an outage)."""
    if isinstance(settings, LocalStorageSettings):
        return LocalStore(settings.local_root, outage)
    store = S3Store(settings, outage)
    store.ensure_bucket()
    return store
