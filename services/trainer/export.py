"""``conveyor export RUN``: a run's scored trajectories as a dataset, for SFT, DPO, rejection
sampling or analysis. Reads what the services wrote, through the same key and storage modules:
the trainer stream (which scored object each trajectory was consumed from), the group records
(advantages), and the trajectory objects.

Invariants:
- One record per trajectory the trainer took in (a ``scored`` event of the run's stream), with
  exactly the scored object the trainer read, never another attempt's.
- ``chat`` form: the prompt messages ``reset`` gave, then each reply (``assistant``) and each
  observation (in the role it was rendered with). ``tokens`` form: token ids, loss mask and the
  inference logprobs, exactly as the trainer's sample would hold them. Both carry the reward,
  the advantage (None while the group is not decided, or when it was dropped), the stop reason,
  the environment, the task id and the dataset version.
- ``pairs`` form, for DPO: one record per group whose best and worst scored members differ in
  reward by more than ``min_margin``: the shared prompt messages, then ``chosen`` (the best
  member's replies and observations) and ``rejected`` (the worst's), with both rewards. Ties
  go to the lower trajectory id, so the pairs are the same in every export.
- Formats: JSONL, Parquet, or a saved Hugging Face dataset (``datasets.load_from_disk``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import redis

from shared.schemas import GroupRecord, ScoredEvent, Trajectory
from shared.storage import ObjectStore, get_model
from shared.state.trainer_stream import trainer_events
from shared.trajectory_lookup import trajectory_of_event

Form = Literal["chat", "tokens", "pairs"]
Format = Literal["jsonl", "parquet", "hf"]


def _advantages(store: ObjectStore, run_id: str) -> dict[str, float | None]:
    advantages: dict[str, float | None] = {}
    for key in store.list_keys(f"groups/{run_id}/"):
        for member in get_model(store, key, GroupRecord).members:
            advantages[member.trajectory_id] = member.advantage
    return advantages


def _chat(trajectory: Trajectory) -> list[dict[str, str]]:
    messages = list(trajectory.prompt_messages)
    for turn in trajectory.turns:
        messages.append({"role": "assistant", "content": turn.completion_text})
        if turn.observation is not None:
            messages.append({"role": trajectory.observation_role, "content": turn.observation})
    return messages


def export_records(client: redis.Redis, store: ObjectStore, run_id: str, form: Form = "chat",
                   min_reward: float | None = None, max_reward: float | None = None,
                   min_margin: float = 0.0) -> Iterator[dict[str, Any]]:
    if form == "pairs":
        yield from preference_pairs(export_records(client, store, run_id, "chat", min_reward, max_reward), min_margin)
        return
    advantages = _advantages(store, run_id)
    for _, event in trainer_events(client, run_id):
        if not isinstance(event, ScoredEvent):
            continue
        if (min_reward is not None and event.reward < min_reward) or (max_reward is not None and event.reward > max_reward):
            continue
        trajectory = trajectory_of_event(store, event, client)
        record: dict[str, Any] = {
            "trajectory_id": event.trajectory_id, "group_id": event.group_id, "task_id": trajectory.request.task.task_id,
            "env_name": trajectory.request.task.env_name, "dataset_version": trajectory.request.task.dataset_version,
            "reward": event.reward, "advantage": advantages.get(event.trajectory_id),
            "stop_reason": trajectory.stop_reason.value,
        }
        if form == "chat":
            record["messages"] = _chat(trajectory)
            record["prompt_length"] = len(trajectory.prompt_messages)
        else:
            flat = trajectory.flatten()
            record |= {"token_ids": flat.token_ids, "loss_mask": flat.loss_mask, "logprobs": flat.inference_logprobs}
        yield record


def preference_pairs(chat_records: Iterator[dict[str, Any]], min_margin: float = 0.0) -> Iterator[dict[str, Any]]:
    """Best against worst member of each group (see the module docstring), in group order."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for record in chat_records:
        groups.setdefault(record["group_id"], []).append(record)
    for group_id, members in sorted(groups.items()):
        best = min(members, key=lambda r: (-r["reward"], r["trajectory_id"]))
        worst = min(members, key=lambda r: (r["reward"], r["trajectory_id"]))
        if best["reward"] - worst["reward"] <= min_margin:
            continue
        cut = best["prompt_length"]
        yield {
            "group_id": group_id, "task_id": best["task_id"], "env_name": best["env_name"],
            "dataset_version": best["dataset_version"], "prompt": best["messages"][:cut],
            "chosen": best["messages"][cut:], "rejected": worst["messages"][cut:],
            "chosen_reward": best["reward"], "rejected_reward": worst["reward"],
            "chosen_id": best["trajectory_id"], "rejected_id": worst["trajectory_id"],
        }


def write_records(records: list[dict[str, Any]], out: Path, fmt: Format) -> Path:
    out = Path(out)
    if fmt == "jsonl":
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w") as fh:
            for record in records:
                fh.write(json.dumps(record) + "\n")
        return out
    import datasets

    dataset = datasets.Dataset.from_list(records)
    if fmt == "parquet":
        out.parent.mkdir(parents=True, exist_ok=True)
        dataset.to_parquet(str(out))
    else:
        dataset.save_to_disk(str(out))
    return out
