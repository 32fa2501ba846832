"""Bundles and refs (``shared.object_bundles``): a ref reads as its member through ``get_model``,
a bundle's members cost one GET, the cache stays bounded, and a missing member or bundle is an
error naming the ref. A scoring batch writes one object, and ``conveyor inspect`` still finds a
bundled trajectory and its score. Real Redis and a real local store."""

from __future__ import annotations

import pytest
from test_ledger import requests_for

from shared.scoring.rewards import RewardCombiner
from shared.scoring.scorer import Scorer
from shared.state.dead_letters import DeadLetters
from shared.state.leases import LeaseKeeper
from shared.state.ledger import SCORING, Ledger
from shared.names import RedisKeys, trajectory_bundle_key
from shared.object_bundles import BundleCache, cache_of, member_ref, split_ref
from shared.schemas import ScoringTask, StopReason, TaskProfile, TrainerEvent, Trajectory, parse_message
from shared.storage import LocalStore, StorageError, get_model, get_models_under, put_bundle, put_model
from shared.trajectory_lookup import find_trajectory


class CountingStore(LocalStore):
    """A real local store that counts its reads."""

    def __init__(self, root):
        super().__init__(root)
        self.reads: list[str] = []

    def get_bytes(self, key: str) -> bytes:
        self.reads.append(key)
        return super().get_bytes(key)


def profiles(n: int) -> list[TaskProfile]:
    return [TaskProfile(task_id=f"task{i}", env_name="qa", task_data={"i": i}) for i in range(n)]


def test_each_ref_reads_as_its_member_and_a_bundle_costs_one_get(tmp_path):
    store = CountingStore(tmp_path)
    members = profiles(5)
    refs = put_bundle(store, "things/b1.bundle.json.gz", members)
    assert refs == [f"things/b1.bundle.json.gz#{i}" for i in range(5)]
    assert [get_model(store, ref, TaskProfile) for ref in reversed(refs)] == members[::-1]
    assert store.reads == ["things/b1.bundle.json.gz"]
    put_model(store, "things/plain.json.gz", members[0])  # a plain key still reads as before
    assert get_model(store, "things/plain.json.gz", TaskProfile) == members[0]
    assert get_models_under(store, "things/", TaskProfile) == members + [members[0]]


def test_a_missing_member_or_bundle_is_an_error_naming_the_ref(tmp_path):
    store = LocalStore(tmp_path)
    [_, ref] = put_bundle(store, "things/b.bundle.json.gz", profiles(2))
    missing = ref.replace("#1", "#2")
    with pytest.raises(StorageError, match=rf"bundle member '{missing}' does not exist: bundle 'things/b.bundle.json.gz' holds 2 members"):
        get_model(store, missing, TaskProfile)
    with pytest.raises(StorageError, match=r"bundle member 'things/gone.bundle.json.gz#0': object 'things/gone.bundle.json.gz' not found"):
        get_model(store, "things/gone.bundle.json.gz#0", TaskProfile)
    with pytest.raises(ValueError, match="not a bundle key"):
        put_bundle(store, "things/plain.json.gz", profiles(1))
    assert split_ref("things/plain.json.gz#3") is None  # only a bundle key makes a ref


def test_the_cache_keeps_the_last_bundles_read_within_its_bounds(tmp_path):
    store = CountingStore(tmp_path)
    keys = [f"b/{n}.bundle.json.gz" for n in range(4)]
    for key in keys:
        put_bundle(store, key, profiles(3))
    cache = BundleCache(max_bundles=2)
    for key in keys + keys[-2:]:
        cache.members(key, lambda key=key: store.get_bytes(key))
    assert len(cache) == 2 and keys[-1] in cache and keys[-2] in cache
    assert store.reads == keys  # the last two were read once each
    small = BundleCache(max_bundles=8, max_bytes=1)  # by bytes: only the newest bundle stays
    for key in keys:
        small.members(key, lambda key=key: store.get_bytes(key))
    assert len(small) == 1 and keys[-1] in small
    assert cache_of(store) is cache_of(store) and cache_of(store) is not cache_of(LocalStore(tmp_path))


def uploaded_in_one_bundle(ledger: Ledger, store: LocalStore, run_id: str, size: int) -> list[ScoringTask]:
    """``size`` trajectories of group 0 as a rollout worker's bundled upload leaves them."""
    requests = requests_for(run_id, size=size)
    ledger.register(requests)
    for request in requests:
        assert ledger.claim(request.trajectory_id, "rollout-token", 30)[0]
    key = trajectory_bundle_key(run_id, 0, requests[0].trajectory_id, 1, "rollout-token")
    refs = put_bundle(store, key, [Trajectory(request=r, turns=[], stop_reason=StopReason.done, env_reward=0.5) for r in requests])
    tasks = [ScoringTask(trajectory_id=r.trajectory_id, trajectory_key=ref) for r, ref in zip(requests, refs)]
    for task in tasks:
        assert ledger.mark_uploaded(task.trajectory_id, "rollout-token", task.model_dump_json()).ok
    return tasks


def test_a_scoring_batch_writes_one_object_and_inspect_finds_each_member(ledger, redis_client, tmp_path, run_id):
    store = CountingStore(tmp_path)
    tasks = uploaded_in_one_bundle(ledger, store, run_id, size=4)
    scorer = Scorer(store, RewardCombiner({"verifier": 1.0}), LeaseKeeper(ledger, 30, 5, SCORING), DeadLetters(redis_client))
    assert scorer.score_batch(tasks) == ["scored"] * 4
    assert len(store.reads) == 1  # the four trajectories: one bundle, one GET
    [scored_object] = store.list_keys(f"scored/{run_id}/")
    assert scored_object.endswith(f"/{tasks[0].trajectory_id}.s1.bundle.json.gz")
    events = [parse_message(TrainerEvent, fields["event"]) for _, fields in ledger.redis.xrange(RedisKeys.trainer_stream(run_id))]
    assert [e.scored_key for e in events] == [member_ref(scored_object, i) for i in range(4)]
    assert [e.trajectory_key for e in events] == [t.trajectory_key for t in tasks]
    for task in tasks:
        found = find_trajectory(store, task.trajectory_id, ledger.redis)
        assert (found.key, found.trajectory.trajectory_id, found.state) == (task.trajectory_key, task.trajectory_id, "scored")
        assert found.scored is not None and found.scored.trajectory_key == task.trajectory_key
    with pytest.raises(LookupError, match=f"no uploaded trajectory {tasks[0].trajectory_id}"):
        find_trajectory(store, tasks[0].trajectory_id)  # without Redis nothing names a bundle's member: said so
