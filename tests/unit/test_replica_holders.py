"""Which runs may share a vLLM replica (``shared.state.replica_holders``), on the session's real Redis:
a run that trains is alone on its replicas, two assemble runs of one base model share them, and a
holder that stopped renewing, or whose follower exited, blocks nobody."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from services.cli.local_stack import free_port
from services.inference.tiny_model import generate_tiny_model
from services.weights.base import BaseWeightsError
from services.weights.follower import WeightFollower
from shared.state.replica_holders import ReplicaHold, ReplicaHolders
from shared.storage import LocalStore

R1, R2 = "http://replica-1:8000", "http://replica-2:8000"
MODEL, OTHER = "/models/tiny", "/models/other"


@pytest.fixture
def holders(redis_client: Any) -> ReplicaHolders:
    return ReplicaHolders(redis_client)


def test_a_run_that_trains_is_alone_on_its_replicas(holders: ReplicaHolders) -> None:
    assert holders.claim([R1], "A", trains=True, model=MODEL) is None
    refusal = holders.claim([R1], "B", trains=False, model=MODEL)
    assert refusal is not None and refusal.replica == R1 and refusal.holder.run_id == "A" and refusal.holder.trains
    assert "A trains on it" in refusal.why()
    assert [h.run_id for h in holders.holders(R1)] == ["A"]


def test_a_run_that_trains_is_refused_a_replica_an_assemble_run_holds(holders: ReplicaHolders) -> None:
    assert holders.claim([R1], "A", trains=False, model=MODEL) is None
    refusal = holders.claim([R2, R1], "B", trains=True, model=MODEL)
    assert refusal is not None and refusal.replica == R1 and "B trains" in refusal.why()
    assert holders.holders(R2) == []  # all or nothing: the free replica was not taken either


def test_two_assemble_runs_of_one_model_share_and_release_their_own_claims(holders: ReplicaHolders) -> None:
    assert holders.claim([R1, R2], "A", trains=False, model=MODEL) is None
    assert holders.claim([R1, R2], "B", trains=False, model=MODEL) is None
    assert sorted(h.run_id for h in holders.holders(R2)) == ["A", "B"]
    assert holders.release([R1, R2], "A") == 2
    assert [h.run_id for h in holders.holders(R1)] == ["B"]
    assert holders.claim([R1], "C", trains=True, model=MODEL) is not None  # B still serves from it
    holders.release([R1, R2], "B")
    assert holders.claim([R1], "C", trains=True, model=MODEL) is None


def test_assemble_runs_of_different_models_are_refused(holders: ReplicaHolders) -> None:
    assert holders.claim([R1], "A", trains=False, model=MODEL) is None
    refusal = holders.claim([R1], "B", trains=False, model=OTHER)
    assert refusal is not None and MODEL in refusal.why() and OTHER in refusal.why()


def test_a_dry_claim_answers_as_a_claim_would_and_holds_nothing(holders: ReplicaHolders) -> None:
    assert holders.claim([R1], "A", trains=False, model=MODEL, dry=True) is None
    assert holders.holders(R1) == []
    assert holders.claim([R1], "A", trains=False, model=MODEL) is None
    assert holders.claim([R1], "B", trains=False, model=MODEL, dry=True) is None  # would share
    refusal = holders.claim([R1], "C", trains=True, model=MODEL, dry=True)
    assert refusal is not None and refusal.holder.run_id == "A" and "C trains" in refusal.why()
    assert [h.run_id for h in holders.holders(R1)] == ["A"]  # neither B nor C holds it


def test_a_holder_that_stopped_renewing_blocks_nobody_after_its_ttl(holders: ReplicaHolders) -> None:
    assert holders.claim([R1], "A", trains=True, model=MODEL, ttl_s=0.3) is None
    assert holders.claim([R1], "B", trains=True, model=MODEL) is not None
    time.sleep(0.4)
    assert holders.holders(R1) == []
    assert holders.claim([R1], "B", trains=True, model=MODEL) is None
    assert [h.run_id for h in holders.holders(R1)] == ["B"]


def test_a_run_takes_its_own_claim_again(holders: ReplicaHolders) -> None:
    assert holders.claim([R1], "A", trains=True, model=MODEL) is None
    assert holders.claim([R1], "A", trains=True, model=MODEL) is None  # a restarted follower


def test_a_live_hold_is_renewed_past_its_ttl_and_released(holders: ReplicaHolders) -> None:
    hold = ReplicaHold(holders, [R1], "A", trains=True, model=MODEL, ttl_s=0.3)
    assert hold.take() is None
    time.sleep(0.6)  # two TTLs: only the heartbeat keeps it
    assert [h.run_id for h in holders.holders(R1)] == ["A"] and hold.lost is None
    hold.release()
    assert holders.holders(R1) == []
    assert holders.claim([R1], "B", trains=True, model=MODEL) is None


def test_a_followers_exit_releases_its_replicas(redis_client: Any, holders: ReplicaHolders, tmp_path: Path) -> None:
    with WeightFollower(redis_client, LocalStore(tmp_path / "objects"), "A", [R1], tmp_path / "weights",
                        initial_weights_dir=tmp_path / "no-model", trains=True) as follower:
        with pytest.raises(BaseWeightsError):  # held, then the base checkpoint is missing
            follower.ensure_base()
        assert [h.run_id for h in holders.holders(R1)] == ["A"]
    assert holders.holders(R1) == []
    assert holders.claim([R1], "C", trains=False, model=MODEL) is None
    with WeightFollower(redis_client, LocalStore(tmp_path / "objects"), "B", [R1], tmp_path / "weights",
                        initial_weights_dir=tmp_path / "no-model", trains=True) as follower:
        with pytest.raises(BaseWeightsError) as refused:
            follower.ensure_base()
    line = str(refused.value)
    assert "\n" not in line and R1 in line and "run C" in line and "inference.base_url" in line \
        and "conveyor run stop C" in line, line


def test_a_server_reached_on_loopback_is_held_under_the_name_the_stack_knows_it_by(
        redis_client: Any, holders: ReplicaHolders, tmp_path: Path) -> None:
    """``conveyor inference`` follows its own vLLM at 127.0.0.1, which the stack's other processes
    reach as ``inference.base_url`` (compose: ``http://inference:8000``): the hold is under that
    name, so a submitted run's follower pointed at it is refused, not let in beside a run that trains."""
    local = "http://127.0.0.1:8000"
    with WeightFollower(redis_client, LocalStore(tmp_path / "objects"), "A", [local], tmp_path / "weights",
                        initial_weights_dir=tmp_path / "no-model", trains=True, hold_names=[R1 + "/"]) as follower:
        with pytest.raises(BaseWeightsError):  # held, then the base checkpoint is missing
            follower.ensure_base()
        assert [h.run_id for h in holders.holders(R1)] == ["A"] and holders.holders(local) == []
        refusal = holders.claim([R1], "B", trains=True, model=MODEL)
        assert refusal is not None and refusal.holder.run_id == "A"
    assert holders.holders(R1) == []


def test_a_launching_inference_holds_its_server_before_it_starts_it(
        redis_url: str, holders: ReplicaHolders, tmp_path: Path) -> None:
    """``conveyor inference`` claims its server under ``inference.base_url`` before it launches
    vLLM, so a run that attached to that URL first (here, run B training on it) refuses the launch
    at once, with the refusal in one line, and no vLLM is started."""
    assert holders.claim([R1], "B", trains=True, model=MODEL) is None
    port = free_port()
    env = {**os.environ, "CONVEYOR_REDIS__URL": redis_url, "CONVEYOR_RUN_ID": "A", "CONVEYOR_INFERENCE__BASE_URL": R1,
           "CONVEYOR_INFERENCE__MODEL_PATH": str(generate_tiny_model(tmp_path / "tiny")),
           "CONVEYOR_INFERENCE__WEIGHTS_DIR": str(tmp_path / "weights"), "CONVEYOR_STORAGE__BACKEND": "local",
           "CONVEYOR_STORAGE__LOCAL_ROOT": str(tmp_path / "objects"), "CONVEYOR_INFERENCE__PORT": str(port)}
    started = time.monotonic()
    refused = subprocess.run([sys.executable, "-m", "services.cli.app", "inference"], env=env, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode != 0 and f"run A cannot use replica {R1}: it is held by run B" in refused.stderr, refused
    assert not (Path(tempfile.gettempdir()) / f"vllm-{port}.log").exists()  # VllmServer.start writes it first
    assert [h.run_id for h in holders.holders(R1)] == ["B"]
    print(f"refused in {time.monotonic() - started:.1f}s")
