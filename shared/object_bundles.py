"""Bundles: many models of one kind in one object, and the refs that name their members (issue 15:
the S3 server's request rate, not its bytes, bounded the trajectories per second).

A bundle is gzip-compressed JSON lines, one model per line, under a key ending in
``BUNDLE_SUFFIX`` (``shared.names`` makes the keys). A member is named by its ref,
``{bundle key}#{index}``; ``shared.storage.get_model`` reads a ref as the member it names, so a
reader handed a ref (an event, a scoring task, a ScoredTrajectory) reads it like any key.

Invariants:
- A bundle is written once, under a key that carries the writing attempt, and never rewritten
  with other content (a retried write writes the same bytes). So a cached bundle is never stale.
- Reading the N members of a bundle costs one GET: ``BundleCache`` keeps the members of the last
  bundles read, at most ``max_bundles`` of them and ``max_bytes`` of member JSON (the newest one
  is kept whatever its size), per store and process. It is thread-safe.
- This module only encodes, decodes and caches; reading, writing and errors are the store's.
"""

from __future__ import annotations

import gzip
import re
import threading
import weakref
from collections import OrderedDict
from typing import Callable, Sequence

from pydantic import BaseModel

BUNDLE_SUFFIX = ".bundle.json.gz"
_REF = re.compile(r"^(.+" + re.escape(BUNDLE_SUFFIX) + r")#(\d+)$")


def member_ref(bundle_key: str, index: int) -> str:
    if not bundle_key.endswith(BUNDLE_SUFFIX):
        raise ValueError(f"{bundle_key!r} is not a bundle key (it must end in {BUNDLE_SUFFIX})")
    return f"{bundle_key}#{index}"


def split_ref(ref: str) -> tuple[str, int] | None:
    """(bundle key, member index) for a member ref, None for a plain object key."""
    match = _REF.match(ref)
    return (match.group(1), int(match.group(2))) if match else None


def is_bundle_key(key: str) -> bool:
    return key.endswith(BUNDLE_SUFFIX)


def encode_bundle(models: Sequence[BaseModel]) -> bytes:
    # model_dump_json escapes every newline inside strings: one line per model
    return gzip.compress(b"\n".join(m.model_dump_json().encode() for m in models), compresslevel=5)


def decode_bundle(data: bytes) -> list[bytes]:
    """The members' JSON, in order."""
    return gzip.decompress(data).split(b"\n")


class BundleCache:
    def __init__(self, max_bundles: int = 8, max_bytes: int = 64 * 2**20):
        self.max_bundles, self.max_bytes = max_bundles, max_bytes
        self._members: OrderedDict[str, list[bytes]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def members(self, bundle_key: str, read: Callable[[], bytes]) -> list[bytes]:
        """The bundle's members, read (``read()``, one GET) only when not cached."""
        with self._lock:
            cached = self._members.get(bundle_key)
            if cached is not None:
                self._members.move_to_end(bundle_key)
                return cached
        members = decode_bundle(read())  # outside the lock: other threads' hits do not wait on the GET
        with self._lock:
            if bundle_key not in self._members:
                self._members[bundle_key] = members
                self._bytes += sum(map(len, members))
            while len(self._members) > 1 and (len(self._members) > self.max_bundles or self._bytes > self.max_bytes):
                _, evicted = self._members.popitem(last=False)
                self._bytes -= sum(map(len, evicted))
        return members

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, bundle_key: str) -> bool:
        return bundle_key in self._members


_caches: "weakref.WeakKeyDictionary[object, BundleCache]" = weakref.WeakKeyDictionary()
_caches_lock = threading.Lock()


def cache_of(store: object) -> BundleCache:
    """The process's cache for this store (a store gone is a cache gone)."""
    with _caches_lock:
        cache = _caches.get(store)
        if cache is None:
            cache = _caches[store] = BundleCache()
        return cache
