"""Faults of the storage itself are waited out (``shared.storage``, ``shared.storage_faults``):
a full disk, a vanished mount and an S3 server answering "full" or "slow down" make a call
wait, say so once and once more when it is over, and then land the write whole; only past
``outage.limit_s`` does a call fail, and a missing object is still an answer at once.
Real faults: a tmpfs filled to the last block, a bind mount taken away and put back, and a
real S3 server (moto) behind a proxy that answers with the S3 server's own errors."""

from __future__ import annotations

import errno
import logging
import threading
import time
from pathlib import Path

import pytest
from disk_faults import BindMount, fill, small_tmpfs
from s3_faults import S3FaultProxy

from shared.outage import OutageTooLong
from shared.settings import OutageSettings, S3StorageSettings
from shared.storage import LocalStore, S3Store, StorageError
from shared.storage_faults import disk_fault, wait_out_disk_faults

FAST = OutageSettings(limit_s=60, backoff_max_s=0.2, log_every_s=1000)


def in_thread(fn) -> tuple[threading.Thread, list]:
    """Run ``fn`` in a thread; its result (or exception) lands in the list."""
    out: list = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def outage_lines(caplog, name: str) -> tuple[int, int]:
    """(unreachable lines, back lines) of the dependency, once its "back" line is due: it is said
    after the dependency stayed up ``backoff_max_s + 1`` s (``shared.outage``)."""
    time.sleep(FAST.backoff_max_s + 1.5)
    text = [r.getMessage() for r in caplog.records]
    return (sum(f"{name} is unreachable" in t for t in text), sum(f"{name} is back after" in t for t in text))


def hidden_files(root: Path) -> list[Path]:
    return [p for p in root.rglob(".tmp-*")]


def test_a_full_disk_is_waited_out_once_and_the_object_lands_whole(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    with small_tmpfs(tmp_path / "objects", size_kib=256) as root:
        store = LocalStore(root, FAST)
        filler = fill(root)
        data = bytes(range(256)) * 400  # 100 KiB: cannot fit while the disk is full
        thread, out = in_thread(lambda: store.put_bytes("trajectories/r/0/a.json.gz", data))
        time.sleep(1.5)
        assert thread.is_alive() and out == []  # waiting, not failed
        assert store.list_keys("trajectories/") == [] and hidden_files(root) == []  # no half object, no leftover
        filler.unlink()
        thread.join(10)
        assert out == [None]
        assert store.get_bytes("trajectories/r/0/a.json.gz") == data
        assert store.list_keys("trajectories/") == ["trajectories/r/0/a.json.gz"] and hidden_files(root) == []
    assert outage_lines(caplog, f"object store at {root}") == (1, 1)


def test_past_the_limit_a_full_disk_fails_the_call_and_leaves_nothing_behind(tmp_path):
    with small_tmpfs(tmp_path / "objects", size_kib=128) as root:
        store = LocalStore(root, OutageSettings(limit_s=1.0, backoff_max_s=0.2, log_every_s=1000))
        fill(root)
        with pytest.raises(OutageTooLong, match=r"object store at .* has been unreachable .* No space left on device"):
            store.put_bytes("k/big.bin", b"x" * 200_000)
        assert hidden_files(root) == [] and not (root / "k" / "big.bin").exists()


def test_a_vanished_mount_is_waited_out_and_never_filled_beneath(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    volume = BindMount(tmp_path / "volume", tmp_path / "objects")
    with volume:
        store = LocalStore(volume.target, FAST)
        store.put_bytes("a/one", b"1")
        volume.unmount()  # the mount point is left, empty
        reader, read = in_thread(lambda: store.get_bytes("a/one"))
        writer, wrote = in_thread(lambda: store.put_bytes("a/two", b"2"))
        time.sleep(1.5)
        assert reader.is_alive() and writer.is_alive()  # not "not found", not written to the disk beneath
        assert list(volume.target.iterdir()) == []
        volume.mount()
        reader.join(10), writer.join(10)
        assert read == [b"1"] and wrote == [None]
        assert (volume.source / "a" / "two").read_bytes() == b"2"
    assert outage_lines(caplog, f"object store at {volume.target}") == (1, 1)


def test_an_unreadable_store_is_waited_out(tmp_path):
    root = tmp_path / "objects"
    store = LocalStore(root, FAST)
    store.put_bytes("a/one", b"1")
    attempts = []

    def denied_then_read() -> bytes:  # EACCES as a non-root service sees a directory made unavailable
        attempts.append(1)
        if len(attempts) < 3:
            raise PermissionError(errno.EACCES, "Permission denied", str(root / "a" / "one"))
        return (root / "a" / "one").read_bytes()

    assert store._call(denied_then_read) == b"1" and len(attempts) == 3


def test_a_missing_object_is_an_answer_at_once(store):
    started = time.monotonic()
    with pytest.raises(StorageError, match="not found"):
        store.get_bytes("no/such/object")
    assert time.monotonic() - started < 1.0


def test_native_writers_disk_faults_are_recognized_and_other_errors_are_not():
    assert disk_fault(OSError(errno.ENOSPC, "No space left on device"))
    assert disk_fault(RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file data/0"))
    assert disk_fault(Exception('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'))
    try:
        try:
            raise OSError(errno.EROFS, "Read-only file system")
        except OSError as inner:
            raise RuntimeError("save failed") from inner
    except RuntimeError as outer:
        assert disk_fault(outer)
    assert not disk_fault(ValueError("bad value")) and not disk_fault(FileNotFoundError(errno.ENOENT, "gone"))


def test_a_checkpoint_scratch_folder_on_a_full_disk_waits(tmp_path):
    with small_tmpfs(tmp_path / "scratch", size_kib=128) as scratch:
        filler = fill(scratch)

        def stage() -> int:
            return (scratch / "weights.bin").write_bytes(b"w" * 100_000)

        thread, out = in_thread(lambda: wait_out_disk_faults("test scratch", stage, FAST))
        time.sleep(1.0)
        assert thread.is_alive()
        filler.unlink()
        thread.join(10)
        assert out == [100_000]


@pytest.mark.parametrize("fault", ["storage_full", "slow_down", "internal"])
def test_an_s3_server_answering_full_or_busy_is_waited_out(s3_endpoint, fault, caplog, run_id):
    caplog.set_level(logging.WARNING)
    proxy = S3FaultProxy(int(s3_endpoint.rpartition(":")[2]))
    try:
        endpoint = f"127.0.0.1:{proxy.port}"
        store = S3Store(S3StorageSettings(endpoint=endpoint, access_key="testing", secret_key="testing", bucket=run_id), FAST)
        store.ensure_bucket()
        proxy.fault = fault
        thread, out = in_thread(lambda: store.put_bytes(f"{run_id}/a", b"payload"))
        time.sleep(1.5)
        assert thread.is_alive() and proxy.refused >= 2
        proxy.fault = None
        thread.join(30)
        assert out == [None] and store.get_bytes(f"{run_id}/a") == b"payload"
        with pytest.raises(StorageError):  # an answer, not a fault: at once
            store.get_bytes(f"{run_id}/missing")
    finally:
        proxy.close()
    assert outage_lines(caplog, f"S3 server at {endpoint}") == (1, 1)
