"""The delta chain over many versions, and its pruning, on the real S3 server (moto): the
trainer's side (real AdamW steps of a small Llama-layout model, bf16 served) and the replicas'
(``DeltaCatchUp`` step files applied to a ``DeltaShadow``, as a worker does), without vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.weights.delta_chain import PAYLOAD, ChainBroken, ChainReader, ChainWriter
from services.weights.delta_prune import chain_versions, prune_chain
from services.weights.delta_shadow import DeltaShadow, read_step
from services.weights.delta_sync import DeltaCatchUp
from shared.names import weight_chain_prefix
from shared.settings import S3StorageSettings
from shared.storage import LocalStore, ObjectStore, S3Store
from test_weight_delta import _versions, bits


def _s3(s3_endpoint: str, run_id: str) -> S3Store:
    store = S3Store(S3StorageSettings(endpoint=s3_endpoint, access_key="testing", secret_key="testing", bucket=run_id))
    store.ensure_bucket()
    return store


class Replica:
    """A replica's side of the chain: step files fetched and decoded, applied to its shadow."""

    def __init__(self, store: ObjectStore, run_id: str, work_dir: Path):
        self.catch_up = DeltaCatchUp(ChainReader(store, run_id), work_dir)
        self.shadow = DeltaShadow()

    def sync(self, target: int) -> list[int]:
        prepared = self.catch_up.prepare(target, self.shadow.version)
        self.shadow.apply([read_step(p) for p in prepared.files])  # checks every tensor's checksum
        self.catch_up.prune(keep_from=target)
        return [s.version for s in prepared.steps]

    def equals(self, tensors: dict[str, torch.Tensor]) -> bool:
        return self.shadow.tensors.keys() == tensors.keys() and all(
            torch.equal(bits(self.shadow.tensors[k]), bits(t)) for k, t in tensors.items())


def test_fifty_versions_reach_a_following_replica_a_late_joiner_and_a_restart_bit_for_bit(
        s3_endpoint: str, run_id: str, tmp_path: Path) -> None:
    versions = _versions(1e-5, 50, torch.bfloat16)
    store = _s3(s3_endpoint, run_id)
    writer = ChainWriter(store, run_id, full_every=10, max_fraction=1.0)
    following = Replica(store, run_id, tmp_path / "following")
    restarted = Replica(store, run_id, tmp_path / "restarted")
    kinds, deleted = {}, []
    for version in range(1, 51):
        kinds[version] = writer.publish(version, versions[version]).version.kind
        if kinds[version] == "full":  # as the trainer does: prune, the following replica serving the version before
            deleted += prune_chain(store, run_id, served=version - 1).deleted
        assert following.sync(version) == [version]
        assert following.equals(versions[version])
        if version == 37:  # a replica joins: the newest full version, then the deltas after it
            late = Replica(store, run_id, tmp_path / "late")
            assert late.sync(37) == list(range(31, 38)) and late.equals(versions[37])
        if version == 12:
            assert restarted.sync(12) == [11, 12]
    assert [v for v, kind in kinds.items() if kind == "full"] == [1, 11, 21, 31, 41]
    assert following.shadow.version == 50 and following.equals(versions[50])
    # the late joiner catches up across a full version (from it); the restarted one, from 12, too
    assert late.sync(50) == list(range(41, 51)) and late.equals(versions[50])
    assert restarted.sync(50) == list(range(41, 51)) and restarted.equals(versions[50])
    # pruning kept the previous segment whole: a follower that planned 38 before 41 came still finds it
    assert deleted == list(range(1, 31)) and sorted(chain_versions(store, run_id)) == list(range(31, 51))
    lagging = Replica(store, run_id, tmp_path / "lagging")
    assert lagging.sync(38) == list(range(31, 39)) and lagging.equals(versions[38])


@pytest.mark.parametrize("backend", ["s3", "local"])
def test_pruning_deletes_only_what_no_replica_can_need(backend: str, s3_endpoint: str, run_id: str,
                                                       tmp_path: Path) -> None:
    store: ObjectStore = _s3(s3_endpoint, run_id) if backend == "s3" else LocalStore(tmp_path / "store")
    versions = _versions(1e-5, 13, torch.bfloat16)
    writer = ChainWriter(store, run_id, full_every=4, max_fraction=1.0)
    for version in range(1, 12):  # fulls at 1, 5, 9
        writer.publish(version, versions[version])
    store.put_bytes(weight_chain_prefix(run_id, 12) + PAYLOAD, b"a writer died before its manifest")
    # the served version decides when it is behind the previous segment: nothing it may need goes
    assert prune_chain(store, run_id, served=3).deleted == ()
    assert prune_chain(store, run_id, served=0).deleted == tuple(range(1, 5))  # nothing of the chain served yet
    assert prune_chain(store, run_id, served=11).deleted == ()
    reader = ChainReader(store, run_id)
    with pytest.raises(ChainBroken, match="version 4 .* is missing"):
        reader.plan(4)
    for target in range(5, 12):  # every target a replica can still be given: whole, from any version held
        assert [s.version for s in reader.plan(target)][0] == (5 if target < 9 else 9)
        assert all(reader.fetch(s) for s in reader.plan(target, have=5 if target > 5 else None))
    # a resumed trainer (a new writer, nothing held) writes a full version: the segment of 5 goes,
    # and so does the uncommitted leftover below the new floor
    ChainWriter(store, run_id, full_every=4, max_fraction=1.0).publish(13, versions[13])
    pruned = prune_chain(store, run_id, served=11)
    assert (pruned.floor, pruned.deleted) == (9, (5, 6, 7, 8))
    assert prune_chain(store, run_id, served=13).deleted == ()  # 12 (uncommitted) is above the floor
    assert sorted(chain_versions(store, run_id)) == [9, 10, 11, 12, 13]
    assert [s.version for s in reader.plan(11)] == [9, 10, 11] and [s.version for s in reader.plan(13)] == [13]
