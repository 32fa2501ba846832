"""Which storage errors are faults of the storage (waited out) and which are answers (raised).

A fault of the disk or the server says nothing about the request: the same write succeeds once
space is freed, the mount is back or the server recovers. Every long-running service waits such
a fault out (``shared.outage``), like an outage of Redis; it fails work only past
``outage.limit_s``, and then as an infrastructure error. An answer (the object does not exist,
the key is refused, the bucket is forbidden) is a ``StorageError`` at once.

Invariants:
- Local store: ENOSPC, EDQUOT, EACCES, EPERM, EIO, EROFS, ESTALE, ENOTCONN, EBUSY, ENODEV,
  ENXIO, ETIMEDOUT, EAGAIN and EINTR are faults, whatever the call; so is the store's root
  directory missing (a vanished mount: ``StoreRootMissing``). A missing object under a present
  root is an answer.
- S3: every error answered with a 5xx status (500, 503, 507), and the error codes that mean
  "later" or "full" (``SlowDown``, ``ServiceUnavailable``, ``InsufficientStorage``, MinIO's
  ``XMinioStorageFull`` and quorum errors) are faults; so are connection errors and timeouts.
- A service's writes to its own disk (``wait_out_disk_faults``) wait out the same faults, as an
  outage of that disk.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Callable, TypeVar

from shared.outage import Dependency
from shared.settings import OutageSettings

T = TypeVar("T")

LOCAL_FAULT_ERRNOS = frozenset({
    errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EIO, errno.EROFS, errno.ESTALE, errno.ENOTCONN,
    errno.EBUSY, errno.ENODEV, errno.ENXIO, errno.ETIMEDOUT, errno.EAGAIN, errno.EINTR,
})

S3_FAULT_CODES = frozenset({
    "InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "RequestTimeTooSkewed", "InsufficientStorage",
    "XMinioStorageFull", "XMinioServerNotInitialized", "XMinioReadQuorum", "XMinioWriteQuorum", "XAmzContentSHA256Mismatch",
    "OperationAborted",
})


class StoreRootMissing(OSError):
    """The local store's root directory is gone (an unmounted volume): a fault, never a reason to
    create it again on the disk beneath."""

    def __init__(self, root: Path):
        super().__init__(errno.ENOENT, "the object store's root directory is missing (an unmounted volume?)", str(root))


def local_fault(exc: BaseException) -> bool:
    """A local filesystem error that is a fault of the disk or the mount, not of the request."""
    return isinstance(exc, StoreRootMissing) or (isinstance(exc, OSError) and exc.errno in LOCAL_FAULT_ERRNOS)


# How libraries that write files in native code report a fault of the disk without an OSError:
# safetensors (Rust: "os error 28"), torch.save ("PytorchStreamWriter failed writing file")
_NATIVE_DISK_FAULT_TEXTS = tuple(os.strerror(code) for code in sorted(LOCAL_FAULT_ERRNOS)) + tuple(
    f"os error {code})" for code in sorted(LOCAL_FAULT_ERRNOS)) + ("PytorchStreamWriter failed writing file",)


def disk_fault(exc: BaseException) -> bool:
    """``local_fault``, or an error raised for one by native code: an OSError among its causes,
    or the fault's text in its message."""
    seen: BaseException | None = exc
    while seen is not None:
        if local_fault(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return any(text in str(exc) for text in _NATIVE_DISK_FAULT_TEXTS)


def s3_fault_status(status: int | None) -> bool:
    return status is not None and status >= 500


def wait_out_disk_faults(what: str, fn: Callable[[], T], outage: OutageSettings | None = None) -> T:
    """``fn()``, a write to this host's own disk (a checkpoint's scratch folder, a metrics file),
    retried while it fails with a fault of the disk, as an outage of ``local disk (what)``:
    logged once when it starts and once when it ends, ``OutageTooLong`` past the limit. ``fn``
    must be safe to run again after a partial failure."""
    return Dependency.named(f"local disk ({what})", outage or OutageSettings()).call(fn, disk_fault)
