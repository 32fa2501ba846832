"""Small trajectories carried inline in the ledger's Redis (``shared.inline_trajectories``), against
a real Redis (standalone and a Redis Cluster: the inline hash is in the run's slot) and the moto
S3 server: the rollout worker's upload, the scorer, the trainer consumer, the exporter, the
viewer and ``conveyor trajectories`` all read a small trajectory back identically, before and
after its group is consumed; a large one still goes to S3; Redis keeps an inline copy only while
it is in flight; and a worker gone after the upload loses nothing."""

from __future__ import annotations

import asyncio
import time

import pytest
from test_groups import GROUP_SIZE, clean_env, drain, register_groups, settings, trajectory_for  # noqa: F401 (fixtures)
from test_runner_failures import Harness, chat  # noqa: F401 (chat: the tokenizer fixture)

from services.rollout_worker.runner import upload_bundle
from shared.scoring.rewards import RewardCombiner
from shared.scoring.scorer import Scorer
from services.trainer.consumer import TrainerConsumer
from services.trainer.export import export_records
from services.viewer.data import ViewerData
from shared.inline_trajectories import inline_ref, is_inline_ref, read_trajectory
from shared.names import RedisKeys, batch_key, inline_spill_key
from shared.object_bundles import split_ref
from shared.redis_clients import redis_for
from shared.schemas import RolloutRequest, ScoringTask, Trajectory, TrainingBatch, Turn, parse_message
from shared.settings import S3StorageSettings, Settings
from shared.state.dead_letters import DeadLetters
from shared.state.leases import LeaseKeeper, LeaseReaper, one_by_one
from shared.state.ledger import SCORING, Ledger
from shared.storage import S3Store, StorageError, get_model
from shared.trajectory_lookup import TrajectoryNotFound, find_trajectory

ON_BOTH_TOPOLOGIES = True  # each test using redis_client runs on the standalone Redis and a Redis Cluster


@pytest.fixture
def s3(s3_endpoint, run_id) -> S3Store:
    store = S3Store(S3StorageSettings(endpoint=s3_endpoint, access_key="testing", secret_key="testing", bucket=run_id))
    store.ensure_bucket()
    return store


def worker(ledger: Ledger, store: S3Store, chat, run_id: str, settings: Settings, **ledger_settings) -> Harness:  # noqa: F811
    ledger_settings = {"inline_max_bytes": 16384, **ledger_settings}  # the lever on (it is opt-in)
    harness = Harness(ledger, store, chat, run_id)
    harness.settings = harness.settings.model_copy(update={"rollout": settings.rollout,
                                                           "ledger": harness.settings.ledger.model_copy(update=ledger_settings)})
    return harness


def finished(req: RolloutRequest, large: bool = False) -> Trajectory:
    """A small trajectory (2 turns, well under 16 KiB of JSON), or one past the default threshold."""
    trajectory = trajectory_for(req).model_copy(update={"env_reward": 0.25 * req.episode_index})
    if large:
        big = Turn(index=2, prompt_token_ids=[7] * 12000, sampled_token_ids=[5], logprobs=[-0.5], policy_version=3,
                   finish_reason="stop", completion_text="c")
        trajectory = trajectory.model_copy(update={"turns": [*trajectory.turns, big]})
    return trajectory


def upload(harness: Harness, ledger: Ledger, reqs: list[RolloutRequest], trajectories: list[Trajectory]) -> list[ScoringTask]:
    """The rollout worker's upload of one task's finished episodes (its claims first)."""
    for req in reqs:
        assert ledger.claim(req.trajectory_id, f"tok-{req.trajectory_id}", 30)[0]
    ctx = asyncio.run(harness.context())
    handed_on = upload_bundle(ctx, [(t, f"tok-{t.trajectory_id}") for t in trajectories])
    assert [str(result) for result, _ in handed_on] == ["uploaded"] * len(reqs)
    return [task for _, task in handed_on if task is not None]


def scorer_of(ledger: Ledger, store: S3Store, redis_client) -> Scorer:
    return Scorer(store, RewardCombiner({"verifier": 1.0}), LeaseKeeper(ledger, 30, 5, SCORING), DeadLetters(redis_client))


def test_small_trajectories_go_inline_a_large_one_to_s3_and_every_reader_reads_them_back_identically(
        settings, ledger, s3, redis_client, redis_topology_url, chat, run_id):  # noqa: F811
    reqs = register_groups(settings, redis_client, 1)[0]
    trajectories = [finished(req, large=req.episode_index == 3) for req in reqs]
    tasks = upload(worker(ledger, s3, chat, run_id, settings), ledger, reqs, trajectories)

    # three inline, stored by the move to uploaded; the large one in a bundle of its own in S3
    assert [is_inline_ref(task.trajectory_key) for task in tasks] == [True, True, True, False]
    assert [task.trajectory_key for task in tasks[:3]] == [inline_ref(t) for t in trajectories[:3]]
    [bundle] = s3.list_keys(f"trajectories/{run_id}/")
    assert split_ref(tasks[3].trajectory_key) == (bundle, 0)
    assert redis_client.hlen(RedisKeys.inline_trajectories(run_id)) == 3
    assert {ledger.state(req.trajectory_id) for req in reqs} == {"uploaded"}
    stored = [parse_message(ScoringTask, ledger.redis.hget(RedisKeys.scoring_tasks(run_id), r.trajectory_id)) for r in reqs]
    assert stored == tasks  # what the scoring reaper would send names the same refs

    assert scorer_of(ledger, s3, redis_client).score_batch(tasks) == ["scored"] * GROUP_SIZE

    viewer = ViewerData(redis_client, s3)
    cli_client = redis_for(redis_topology_url)  # `conveyor trajectories` opens its own client

    def every_reader_reads_each_back_identically() -> None:
        for trajectory, task in zip(trajectories, tasks):
            assert read_trajectory(s3, cli_client, task.trajectory_key) == trajectory
            assert viewer.trajectory(trajectory.trajectory_id).trajectory == trajectory
            found = find_trajectory(s3, trajectory.trajectory_id, cli_client)
            assert (found.key, found.trajectory, found.scored.trajectory_key) == (task.trajectory_key, trajectory, task.trajectory_key)
        exported = {r["trajectory_id"]: r for r in export_records(redis_client, s3, run_id, "tokens")}
        assert [exported[t.trajectory_id]["token_ids"] for t in trajectories] == [t.flatten().token_ids for t in trajectories]
        assert [exported[t.trajectory_id]["reward"] for t in trajectories] == [0.0, 0.25, 0.5, 0.75]

    every_reader_reads_each_back_identically()

    consumer = TrainerConsumer(settings, redis_client, s3)
    assert drain(consumer) == GROUP_SIZE
    batch = get_model(s3, batch_key(run_id, 0), TrainingBatch)
    assert [s.token_ids for s in batch.samples] == [t.flatten().token_ids for t in trajectories]
    assert [s.inference_logprobs for s in batch.samples] == [t.flatten().inference_logprobs for t in trajectories]

    # consumed: Redis holds no copy any more; the group's spill holds the inline ones, read by the same refs
    assert {ledger.state(req.trajectory_id) for req in reqs} == {"consumed"}
    assert redis_client.exists(RedisKeys.inline_trajectories(run_id)) == 0
    assert inline_spill_key(run_id, 0) in s3.list_keys(f"trajectories/{run_id}/")
    every_reader_reads_each_back_identically()
    for trajectory in trajectories[:3]:  # without Redis too, as `conveyor inspect` on a bucket alone
        assert find_trajectory(s3, trajectory.trajectory_id).trajectory == trajectory


def test_a_failed_or_expired_trajectory_leaves_no_inline_copy_and_zero_keeps_every_trajectory_an_object(
        settings, ledger, s3, redis_client, chat, run_id):  # noqa: F811
    reqs = register_groups(settings, redis_client, 2)
    tasks = upload(worker(ledger, s3, chat, run_id, settings), ledger, reqs[0], [finished(r) for r in reqs[0]])
    inline = RedisKeys.inline_trajectories(run_id)
    assert redis_client.hlen(inline) == GROUP_SIZE and s3.list_keys("trajectories/") == []

    assert ledger.fail(tasks[0].trajectory_id, "env_error: gone").ok  # e.g. `conveyor run stop`
    assert not redis_client.hexists(inline, tasks[0].trajectory_id)
    with pytest.raises(StorageError, match="no longer holds it"):
        read_trajectory(s3, redis_client, tasks[0].trajectory_key)
    with pytest.raises(TrajectoryNotFound, match=r"the ledger says failed \(env_error: gone\)"):
        find_trajectory(s3, tasks[0].trajectory_id, redis_client)  # the viewer's and the CLI's lookup says why

    # a scorer's lease runs out on the last attempt: the reaper fails it, and its copy goes with it
    assert ledger.claim(tasks[1].trajectory_id, "dead-scorer", 0.01, SCORING, tasks[1].model_dump_json())[0]
    time.sleep(0.05)
    assert LeaseReaper(ledger, SCORING, 1, 1.0, one_by_one(lambda *_: None)).sweep()["failed"] == 1
    assert ledger.state(tasks[1].trajectory_id) == "failed"
    assert sorted(redis_client.hkeys(inline)) == sorted(t.trajectory_id for t in tasks[2:])

    # inline_max_bytes 0: the same small trajectories are an object each, as before
    objects = upload(worker(ledger, s3, chat, run_id, settings, inline_max_bytes=0), ledger, reqs[1], [finished(r) for r in reqs[1]])
    assert not any(is_inline_ref(task.trajectory_key) for task in objects)
    assert len(s3.list_keys(f"trajectories/{run_id}/000001/")) == 1
    assert redis_client.hlen(inline) == 2


def test_a_worker_gone_after_the_upload_loses_nothing_the_scoring_reaper_sends_it_from_the_ledger(
        settings, ledger, s3, redis_client, redis_topology_url, chat, run_id):  # noqa: F811
    reqs = register_groups(settings, redis_client, 1)[0]
    trajectories = [finished(r) for r in reqs]
    # the worker uploads (a short send-by: lease 0.2 s) and dies before its scoring messages go out
    harness = worker(ledger, s3, chat, run_id, settings, lease_ttl_s=0.2)
    tasks = upload(harness, ledger, reqs, trajectories)
    assert s3.list_keys("trajectories/") == []  # no object: Redis alone holds them
    del harness

    time.sleep(0.7)  # the send-by deadlines (lease 0.2 s + scoring linger 0.25 s) pass
    survivor = Ledger(redis_for(redis_topology_url))  # another process: the reaper's, then a scorer's
    scorer = scorer_of(survivor, s3, survivor.redis)
    outcomes: list[str] = []
    reaper = LeaseReaper(survivor, SCORING, 3, 1.0, one_by_one(lambda _tid, payload: outcomes.append(
        scorer.score(parse_message(ScoringTask, payload)))))
    assert reaper.sweep()["resent"] == GROUP_SIZE
    assert outcomes == ["scored"] * GROUP_SIZE
    assert [read_trajectory(s3, survivor.redis, task.trajectory_key) for task in tasks] == trajectories
    consumer = TrainerConsumer(settings, survivor.redis, s3)
    assert drain(consumer) == GROUP_SIZE
    assert [s.token_ids for s in get_model(s3, batch_key(run_id, 0), TrainingBatch).samples] == \
        [t.flatten().token_ids for t in trajectories]
    assert survivor.counts(run_id)["consumed"] == GROUP_SIZE
