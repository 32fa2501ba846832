"""``conveyor export`` (issue 13, item 6): a run's consumed trajectories, in chat and token form,
as JSONL, Parquet and a saved Hugging Face dataset that round-trips through
``datasets.load_from_disk``; exactly the scored object the trainer read. Real Redis, the
filesystem object store, the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import datasets

from services.trainer.export import export_records, write_records
from shared.names import RedisKeys, scored_key, trajectory_key
from shared.schemas import (GroupMember, GroupRecord, RolloutRequest, ScoredEvent, ScoredTrajectory, StopReason,
                            TaskProfile, Trajectory, Turn)
from shared.storage import LocalStore, put_model


def _stage_run(store: LocalStore, client, run_id: str) -> list[str]:
    """Two trajectories of group 0 consumed by the trainer; the first was scored twice (attempt 2
    is what the trainer read); a third was scored but never reached the stream."""
    task = TaskProfile(task_id="t0", env_name="qa", task_data={"question": "2+2?", "answer": "4"}, dataset_version="v1@abc")
    ids = []
    for index, (reply, reward) in enumerate([("It is 4.", 1.0), ("Five.", 0.0), ("4", 1.0)]):
        tid = f"{run_id}_0_{index}_{index}"
        request = RolloutRequest(run_id=run_id, group_id=0, episode_index=index, episode_seed=index, trajectory_id=tid,
                                 group_size=3, task=task, dispatched_at=time.time())
        turns = [Turn(index=0, prompt_token_ids=[1, 2, 3], sampled_token_ids=[7, 8], logprobs=[-0.5, -0.25],
                      policy_version=0, finish_reason="stop", completion_text=reply, observation="try again"),
                 Turn(index=1, prompt_token_ids=[4], sampled_token_ids=[9], logprobs=[-0.1], policy_version=0,
                      finish_reason="stop", completion_text="done")]
        trajectory = Trajectory(request=request, turns=turns, stop_reason=StopReason.done, env_reward=reward,
                                prompt_messages=[{"role": "user", "content": "2+2?"}])
        put_model(store, trajectory_key(run_id, 0, tid), trajectory)
        for attempt in (1, 2) if index == 0 else (1,):
            scored = ScoredTrajectory(trajectory_id=tid, run_id=run_id, group_id=0, trajectory_key=trajectory_key(run_id, 0, tid),
                                      reward=reward if attempt == 2 or index else -9.0, components=[],
                                      stop_reason=StopReason.done, scored_at=time.time())
            put_model(store, scored_key(run_id, 0, tid, attempt), scored)
        if index < 2:
            event = ScoredEvent(trajectory_id=tid, run_id=run_id, group_id=0, reward=reward,
                                scored_key=scored_key(run_id, 0, tid, 2 if index == 0 else 1), at=time.time())
            client.xadd(RedisKeys.trainer_stream(run_id), {"event": event.model_dump_json()})
            ids.append(tid)
    record = GroupRecord(run_id=run_id, group_id=0, expected_size=2, reward_mean=0.5, reward_std=0.5, status="accepted",
                         members=[GroupMember(trajectory_id=ids[0], reward=1.0, advantage=1.0),
                                  GroupMember(trajectory_id=ids[1], reward=0.0, advantage=-1.0)], completed_at=time.time())
    put_model(store, f"groups/{run_id}/000000.json.gz", record)
    return ids


def test_chat_and_token_forms_hold_what_the_trainer_read(tmp_path, redis_client, run_id):
    store = LocalStore(tmp_path / "objects")
    ids = _stage_run(store, redis_client, run_id)
    chat = list(export_records(redis_client, store, run_id, "chat"))
    assert [r["trajectory_id"] for r in chat] == ids  # the third never reached the trainer
    assert chat[0]["messages"] == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is 4."},
                                   {"role": "user", "content": "try again"}, {"role": "assistant", "content": "done"}]
    assert (chat[0]["reward"], chat[0]["advantage"], chat[1]["advantage"]) == (1.0, 1.0, -1.0)
    assert chat[0]["dataset_version"] == "v1@abc" and chat[0]["env_name"] == "qa"
    tokens = list(export_records(redis_client, store, run_id, "tokens", min_reward=0.5))
    assert [r["trajectory_id"] for r in tokens] == ids[:1]
    assert tokens[0]["token_ids"] == [1, 2, 3, 7, 8, 4, 9] and tokens[0]["loss_mask"] == [0, 0, 0, 1, 1, 0, 1]
    assert tokens[0]["logprobs"] == [0, 0, 0, -0.5, -0.25, 0, -0.1]


def test_the_formats_round_trip(tmp_path, redis_client, run_id):
    store = LocalStore(tmp_path / "objects")
    _stage_run(store, redis_client, run_id)
    records = list(export_records(redis_client, store, run_id, "chat"))
    loaded = datasets.load_from_disk(str(write_records(records, tmp_path / "hf", "hf")))
    assert loaded.num_rows == 2 and loaded[0]["messages"][1]["content"] == "It is 4." and loaded[1]["advantage"] == -1.0
    parquet = datasets.Dataset.from_parquet(str(write_records(records, tmp_path / "out.parquet", "parquet")))
    assert parquet["trajectory_id"] == [r["trajectory_id"] for r in records]
    lines = (write_records(records, tmp_path / "out.jsonl", "jsonl")).read_text().splitlines()
    assert [json.loads(line) for line in lines] == records


def test_conveyor_export_writes_the_dataset_and_refuses_an_empty_run(tmp_path, redis_url, redis_client, run_id):
    store = LocalStore(tmp_path / "objects")
    _stage_run(store, redis_client, run_id)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}, "CONVEYOR_REDIS__URL": redis_url,
           "CONVEYOR_STORAGE__BACKEND": "local", "CONVEYOR_STORAGE__LOCAL_ROOT": str(tmp_path / "objects")}

    def export(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "services.cli.app", "export", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)

    done = export(run_id, "--out", str(tmp_path / "ds"), "--format", "hf", "--form", "tokens")
    assert done.returncode == 0, done.stderr
    assert datasets.load_from_disk(str(tmp_path / "ds")).num_rows == 2
    assert f"export {run_id}: reading trajectories: 2 done in" in done.stderr  # progress goes to stderr
    empty = export(run_id + "x", "--out", str(tmp_path / "none.jsonl"))
    assert empty.returncode == 2 and f"run {run_id}x: no consumed trajectory to export" in empty.stderr


def test_pairs_form_puts_a_groups_best_against_its_worst_for_dpo(tmp_path, redis_client, run_id):
    store = LocalStore(tmp_path / "objects")
    ids = _stage_run(store, redis_client, run_id)
    (pair,) = export_records(redis_client, store, run_id, "pairs")
    assert pair["prompt"] == [{"role": "user", "content": "2+2?"}]
    assert pair["chosen"][0] == {"role": "assistant", "content": "It is 4."} and pair["chosen_reward"] == 1.0
    assert pair["rejected"][0] == {"role": "assistant", "content": "Five."} and pair["rejected_reward"] == 0.0
    assert (pair["chosen_id"], pair["rejected_id"], pair["task_id"]) == (ids[0], ids[1], "t0")
    assert not list(export_records(redis_client, store, run_id, "pairs", min_margin=1.0))  # a margin it does not pass
    loaded = datasets.load_from_disk(str(write_records([pair], tmp_path / "pairs", "hf")))
    assert loaded[0]["chosen"][0]["content"] == "It is 4."
