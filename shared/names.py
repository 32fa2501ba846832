"""Queue names, Redis keys and the object-key layout: every service names things through here.

Object key layout (one bucket):
- ``trajectories/{run}/{group_id:06d}/{trajectory_id}.json.gz`` — the Trajectory, gzip JSON
- ``scored/{run}/{group_id:06d}/{trajectory_id}.json.gz`` — the ScoredTrajectory (a re-dispatched
  scoring attempt n > 1 writes ``{trajectory_id}.s{n}.json.gz``, so a scorer presumed dead never
  overwrites the object the trainer is told about)
- bundles (``shared.object_bundles``), many of those in one object, each named after its first
  member and the attempt that wrote it, so no other attempt ever writes the same key:
  ``trajectories/{run}/{group_id:06d}/{trajectory_id}.a{attempt}-{lease token[:8]}.bundle.json.gz``
  (a rollout task's uploads) and ``scored/{run}/{group_id:06d}/{trajectory_id}.s{n}.bundle.json.gz``
  (a scoring batch's, of one run); a member's ref is ``{bundle key}#{index}``
- ``trajectories/{run}/{group_id:06d}/inline-{group_id:06d}.bundle.json.gz`` — the trajectories of a
  consumed group that were carried inline in Redis (``shared.inline_trajectories``), written by
  the trainer before it consumes them
- ``batches/{run}/{group_id:06d}.json.gz`` — a training batch (one GRPO group)
- ``groups/{run}/{group_id:06d}.json.gz`` — the GroupRecord the trainer decided
- ``checkpoints/{run}/{version:06d}/`` — a policy checkpoint: safetensors, config and
  tokenizer files, ``trainer_state.pt``, and the ``COMMITTED`` manifest written last
- ``runs/{run}/marker.json`` — the run's marker, written by intake after the one in Redis
  (``RedisKeys.run_marker``); it tells that Redis should hold the run (``shared.state.run_marker``)
Rejected dataset rows live in Redis (``RedisKeys.rejected_rows``), not in the bucket.
"""

from __future__ import annotations

from shared.object_bundles import BUNDLE_SUFFIX

ROLLOUT_QUEUE = "rollouts"
SCORING_QUEUE = "scoring"

ROLLOUT_TASK = "conveyor.rollout.run_trajectories"
SCORING_TASK = "conveyor.scoring.score_trajectory"

_P = "conveyor"


def trajectory_key(run_id: str, group_id: int, trajectory_id: str) -> str:
    """A Trajectory uploaded on its own (not in a bundle), gzip JSON."""
    return f"trajectories/{run_id}/{group_id:06d}/{trajectory_id}.json.gz"


def scored_key(run_id: str, group_id: int, trajectory_id: str, attempt: int = 1) -> str:
    """A ScoredTrajectory on its own, gzip JSON; scoring attempt n > 1 writes a key of its own."""
    suffix = "" if attempt == 1 else f".s{attempt}"
    return f"scored/{run_id}/{group_id:06d}/{trajectory_id}{suffix}.json.gz"


def trajectory_bundle_key(run_id: str, group_id: int, first_trajectory_id: str, attempt: int, lease_token: str) -> str:
    """A rollout task's uploads, named after its first member's attempt and lease token."""
    return f"trajectories/{run_id}/{group_id:06d}/{first_trajectory_id}.a{attempt}-{lease_token[:8]}{BUNDLE_SUFFIX}"


def inline_spill_key(run_id: str, group_id: int) -> str:
    """The consumed group's trajectories that were carried inline, as one bundle (``shared.inline_trajectories``)."""
    return f"trajectories/{run_id}/{group_id:06d}/inline-{group_id:06d}{BUNDLE_SUFFIX}"


def scored_bundle_key(run_id: str, group_id: int, first_trajectory_id: str, scoring_attempt: int) -> str:
    """A scoring batch's ScoredTrajectories of one run, named after its first member's scoring attempt."""
    return f"scored/{run_id}/{group_id:06d}/{first_trajectory_id}.s{scoring_attempt}{BUNDLE_SUFFIX}"


def agent_artifact_key(run_id: str, trajectory_id: str, name: str) -> str:
    """A file an agent left in its artifacts directory (``agent_coding``), next to the coding artifacts."""
    return f"artifacts/{run_id}/{trajectory_id}/agent/{name}"


def batch_key(run_id: str, group_id: int) -> str:
    """A training batch: one GRPO group's samples, gzip JSON."""
    return f"batches/{run_id}/{group_id:06d}.json.gz"


def group_record_key(run_id: str, group_id: int) -> str:
    """The GroupRecord the trainer decided for a group (accepted, or why not)."""
    return f"groups/{run_id}/{group_id:06d}.json.gz"


CHECKPOINT_COMMITTED = "COMMITTED"  # written last; a checkpoint without it does not exist
CHECKPOINT_PROBE = "logprob_probe.json"  # the trainer's logprobs of a fixed sequence (services.policy.probe)
CHECKPOINT_TRAINER_STATE = "trainer_state.pt"  # optimizer state and step: the trainer's only
# a sharded trainer's (torchrun) model and optimizer shards, torch.distributed.checkpoint's files: the trainer's only
CHECKPOINT_SHARDED_STATE = "trainer_state_sharded"
# peft's adapter config: its presence marks an adapter-only checkpoint (trainer.lora.sync: adapter)
CHECKPOINT_ADAPTER_CONFIG = "adapter_config.json"


def lora_adapter_name(served_model: str, version: int) -> str:
    """The name vLLM serves version ``version``'s LoRA adapter under (trainer.lora.sync: adapter);
    version 0 is the base model, under its own name."""
    return served_model if version == 0 else f"{served_model}-v{version}"


def lora_adapter_version(served_model: str, name: str) -> int | None:
    """The version ``lora_adapter_name(served_model, version)`` named, or None for another name."""
    stem = f"{served_model}-v"
    digits = name[len(stem):] if name.startswith(stem) else ""
    return int(digits) if digits.isdigit() and digits == str(int(digits)) and int(digits) > 0 else None


def run_marker_key(run_id: str) -> str:
    """The run's marker in the bucket, written by intake after the one in Redis (shared.state.run_marker)."""
    return f"runs/{run_id}/marker.json"


def checkpoints_of_run(run_id: str) -> str:
    """Every checkpoint of a run."""
    return f"checkpoints/{run_id}/"


def checkpoint_prefix(run_id: str, version: int) -> str:
    """One policy checkpoint: safetensors, config and tokenizer files, trainer state, COMMITTED last."""
    return f"{checkpoints_of_run(run_id)}{version:06d}/"


def weight_chain_of_run(run_id: str) -> str:
    """A run's delta weight chain (``inference.weight_sync: delta``, ``services.weights.delta_chain``)."""
    return f"weight_chain/{run_id}/"


def weight_chain_prefix(run_id: str, version: int) -> str:
    """One version of the chain: its payload, then its manifest (``COMMITTED``) last."""
    return f"{weight_chain_of_run(run_id)}{version:06d}/"


class RedisKeys:
    """Redis key names. Per-run keys share a hash tag so a cluster keeps a run on one slot."""

    runs = f"{_P}:runs"  # set of run ids: the run registry, cross-run (the reapers iterate it)
    # hash replica URL -> JSON {run_id: {trains, model, until}}: whose weight follower holds it (shared.state.replica_holders)
    replica_holders = f"{_P}:replica_holders"
    dead_letters = f"{_P}:dead_letters"  # list of messages that did not fit their schema, all runs (shared.state.dead_letters)

    @staticmethod
    def run_marker(run_id: str) -> str:  # JSON {run_id, created_at}: Redis holds the run (shared.state.run_marker)
        return f"{_P}:{{{run_id}}}:marker"

    @staticmethod
    def leases(run_id: str) -> str:  # zset trajectory_id -> rollout lease or dispatch deadline (unix s)
        return f"{_P}:{{{run_id}}}:leases"

    @staticmethod
    def scoring_leases(run_id: str) -> str:  # zset trajectory_id -> scoring lease or send-by deadline
        return f"{_P}:{{{run_id}}}:scoring_leases"

    @staticmethod
    def states(run_id: str) -> str:  # hash trajectory_id -> state ("failed" detail in `failures`)
        return f"{_P}:{{{run_id}}}:state"

    @staticmethod
    def counts(run_id: str) -> str:  # hash state -> count; kept in step with `states` by Lua
        return f"{_P}:{{{run_id}}}:counts"

    @staticmethod
    def failures(run_id: str) -> str:  # hash trajectory_id -> failure reason
        return f"{_P}:{{{run_id}}}:failures"

    @staticmethod
    def owners(run_id: str) -> str:  # hash trajectory_id -> lease token of the current attempt
        return f"{_P}:{{{run_id}}}:owners"

    @staticmethod
    def attempts(run_id: str) -> str:  # hash trajectory_id -> attempts started
        return f"{_P}:{{{run_id}}}:attempts"

    @staticmethod
    def resends(run_id: str) -> str:  # hash trajectory_id -> rollout messages re-sent since its last claim
        return f"{_P}:{{{run_id}}}:resends"

    @staticmethod
    def scoring_resends(run_id: str) -> str:  # hash trajectory_id -> scoring messages re-sent since its last claim
        return f"{_P}:{{{run_id}}}:scoring_resends"

    @staticmethod
    def scoring_owners(run_id: str) -> str:  # hash trajectory_id -> token of the scoring attempt
        return f"{_P}:{{{run_id}}}:scoring_owners"

    @staticmethod
    def scoring_attempts(run_id: str) -> str:  # hash trajectory_id -> scoring attempts started
        return f"{_P}:{{{run_id}}}:scoring_attempts"

    @staticmethod
    def scoring_tasks(run_id: str) -> str:  # hash trajectory_id -> scoring task args JSON (re-dispatch)
        return f"{_P}:{{{run_id}}}:scoring_tasks"

    @staticmethod
    def inline_trajectories(run_id: str) -> str:  # hash trajectory_id -> Trajectory JSON carried inline, while in flight
        return f"{_P}:{{{run_id}}}:inline_trajectories"

    @staticmethod
    def requests(run_id: str) -> str:  # hash trajectory_id -> RolloutRequest JSON (re-dispatch)
        return f"{_P}:{{{run_id}}}:requests"

    @staticmethod
    def groups(run_id: str) -> str:  # hash group_id -> GroupRegistration JSON (shared.state.group_registry)
        return f"{_P}:{{{run_id}}}:groups"

    @staticmethod
    def groups_published(run_id: str) -> str:  # set of group ids intake has published
        return f"{_P}:{{{run_id}}}:groups_published"

    @staticmethod
    def groups_done(run_id: str) -> str:  # set of group ids the trainer has completed
        return f"{_P}:{{{run_id}}}:groups_done"

    @staticmethod
    def trainer_stream(run_id: str) -> str:  # stream of {"event": TrainerEvent JSON}
        return f"{_P}:{{{run_id}}}:to_trainer"

    @staticmethod
    def rejected_rows(run_id: str) -> str:  # list of {"source", "reason"} JSON
        return f"{_P}:{{{run_id}}}:rejected"

    @staticmethod
    def dataset_versions(run_id: str) -> str:  # set of dataset versions intake published from
        return f"{_P}:{{{run_id}}}:dataset_versions"

    @staticmethod
    def intake_done(run_id: str) -> str:  # "1" once intake dispatched everything it will
        return f"{_P}:{{{run_id}}}:intake_done"

    @staticmethod
    def run_stop(run_id: str) -> str:  # JSON RunStop: `conveyor run stop` asked the run to end (shared.state.run_stop)
        return f"{_P}:{{{run_id}}}:stop"

    @staticmethod
    def policy_version(run_id: str) -> str:  # int: the version the inference service serves (shared.state.policy_version)
        return f"{_P}:{{{run_id}}}:policy_version"

    @staticmethod
    def staleness(run_id: str) -> str:  # hash: admitted, filtered, trainer_step, begun_step (shared.state.staleness)
        return f"{_P}:{{{run_id}}}:staleness"

    @staticmethod
    def checkpoints(run_id: str) -> str:  # stream: a CheckpointAnnouncement per committed checkpoint
        return f"{_P}:{{{run_id}}}:checkpoints"

    @staticmethod
    def weight_sync(run_id: str) -> str:  # hash: the last weight sync and failure (shared.state.weight_sync_record)
        return f"{_P}:{{{run_id}}}:weight_sync"

    @staticmethod
    def train_cursor(run_id: str) -> str:  # hash: policy version -> train-queue position after its step
        return f"{_P}:{{{run_id}}}:train_cursor"

    @staticmethod
    def train_queue(run_id: str) -> str:  # list of TrainQueueEntry JSON, append-only
        return f"{_P}:{{{run_id}}}:train_queue"

    @staticmethod
    def step_metrics(run_id: str) -> str:  # stream of {"metrics": JSON} per optimizer step, capped (the viewer's curves)
        return f"{_P}:{{{run_id}}}:steps"

    @staticmethod
    def eval_stream(run_id: str) -> str:  # stream of {"eval": EvalEnd JSON}: the end signal of each eval pass
        return f"{_P}:{{{run_id}}}:eval"

    @staticmethod
    def eval_ends(run_id: str) -> str:  # hash: policy version -> EvalEnd JSON, written once per version
        return f"{_P}:{{{run_id}}}:eval_ends"

    @staticmethod
    def trainer_counters(run_id: str) -> str:  # hash: counter -> int (shared.state.trainer_counters)
        return f"{_P}:{{{run_id}}}:trainer"


# The keys that span runs, each one key in one slot, so no script or transaction ever pairs it
# with another key (shared.redis_clients; docs/compose.md says why each is safe on a cluster).
# Every other key is a run's: ``conveyor:{run_id}:...``, all of a run in the run's one slot.
CROSS_RUN_KEYS = ("runs", "replica_holders", "dead_letters")

_LEDGER = "shared.state.ledger"
# Each Redis key's one owner: the only module that names it. Any other module reads or changes the
# key through its owner's methods; tests/unit/test_key_ownership.py fails on any other module that
# names it. Every owner is a module of shared.state, or a package of it whose modules are the owner
# together (the ledger: shared/state/ledger/).
REDIS_KEY_OWNERS: dict[str, str] = {
    **dict.fromkeys(("runs", "leases", "scoring_leases", "states", "counts", "failures", "owners", "attempts",
                     "resends", "scoring_resends", "scoring_owners", "scoring_attempts", "scoring_tasks",
                     "requests", "inline_trajectories"), _LEDGER),
    "dead_letters": "shared.state.dead_letters",
    "replica_holders": "shared.state.replica_holders",
    "run_marker": "shared.state.run_marker",
    "groups": "shared.state.group_registry",
    "groups_published": "shared.state.group_registry",
    "groups_done": "shared.state.group_registry",
    "trainer_stream": "shared.state.trainer_stream",
    "rejected_rows": "shared.state.run_records",
    "dataset_versions": "shared.state.run_records",
    "intake_done": "shared.state.run_records",
    "run_stop": "shared.state.run_stop",
    "policy_version": "shared.state.policy_version",
    "staleness": "shared.state.staleness",
    "checkpoints": "shared.state.checkpoint_announcements",
    "weight_sync": "shared.state.weight_sync_record",
    "train_cursor": "shared.state.train_queue",
    "train_queue": "shared.state.train_queue",
    "step_metrics": "shared.state.step_metrics",
    "eval_stream": "shared.state.eval_ends",
    "eval_ends": "shared.state.eval_ends",
    "trainer_counters": "shared.state.trainer_counters",
}
