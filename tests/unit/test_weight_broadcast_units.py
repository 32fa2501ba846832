"""The broadcast weight-sync path without vLLM: the settings choice, its refusal without CUDA,
and the process group itself between two real processes over gloo (the same code as nccl)."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from services.cli.local_stack import free_port
from services.weights.broadcast import WeightBroadcaster, bucket_layout
from shared.settings import NcclWeightSync, S3WeightSync, SettingsError, load_settings
from services.weights.process_group import WeightProcessGroup, WeightProcessGroupError

SENT = [("a", torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7),
        ("b", (torch.arange(5, dtype=torch.float32) - 2.5).to(torch.bfloat16)),
        ("c", torch.tensor([3, -1, 2**40], dtype=torch.int64))]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    monkeypatch.setenv("CONVEYOR_CONFIG", "placeholder")
    for name in list(os.environ):
        if name.startswith("CONVEYOR_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def test_s3_is_the_default_and_nccl_is_a_choice(monkeypatch):
    assert load_settings().inference.weight_sync == S3WeightSync()
    monkeypatch.setenv("CONVEYOR_INFERENCE__WEIGHT_SYNC", "nccl")  # the mode alone, and an older flat name
    monkeypatch.setenv("CONVEYOR_INFERENCE__WEIGHT_SYNC_HOST", "10.0.0.5")
    assert load_settings().inference.weight_sync == NcclWeightSync(host="10.0.0.5", port=29531)


def test_weight_sync_reads_its_nested_names_and_refuses_a_whole_and_a_field_together(monkeypatch):
    monkeypatch.setenv("CONVEYOR_INFERENCE__WEIGHT_SYNC__MODE", "nccl")
    monkeypatch.setenv("CONVEYOR_INFERENCE__WEIGHT_SYNC__PORT", "4000")
    assert load_settings().inference.weight_sync == NcclWeightSync(port=4000)
    monkeypatch.setenv("CONVEYOR_INFERENCE__WEIGHT_SYNC", "nccl")  # would silently replace the port
    with pytest.raises(SettingsError, match="CONVEYOR_INFERENCE__WEIGHT_SYNC sets the whole setting, and "
                                            "CONVEYOR_INFERENCE__WEIGHT_SYNC__MODE a field of it"):
        load_settings()
    monkeypatch.delenv("CONVEYOR_INFERENCE__WEIGHT_SYNC")
    monkeypatch.setenv("CONVEYOR_INFERENCE__WEIGHT_SYNC__MODE", "s3")  # a field of the other mode names itself
    with pytest.raises(SettingsError, match=r"inference.weight_sync.s3.port: Extra inputs are not permitted"):
        load_settings()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without a GPU")
def test_nccl_without_cuda_is_refused_before_any_replica_is_touched():
    from services.trainer.broadcast_publish import BroadcastPublisher

    settings = load_settings(inference={"weight_sync": "nccl", "base_url": "http://127.0.0.1:9"})
    with pytest.raises(WeightProcessGroupError, match="nccl weight-sync path needs CUDA.*inference.weight_sync: s3"):
        WeightBroadcaster.from_settings(settings)
    with pytest.raises(WeightProcessGroupError, match="needs CUDA"):  # the trainer refuses at start
        BroadcastPublisher(settings, redis_client=None, store=None)
    with pytest.raises(WeightProcessGroupError, match="needs CUDA"):
        WeightProcessGroup("nccl", "127.0.0.1", free_port(), 0, 2)


def test_gloo_backend_broadcasts_from_the_trainers_memory_on_a_host_without_cuda(monkeypatch):
    """``backend: gloo``: the broadcast path (and its background checkpoint) for CPU replicas."""
    monkeypatch.setenv("CONVEYOR_INFERENCE__WEIGHT_SYNC__MODE", "nccl")
    monkeypatch.setenv("CONVEYOR_INFERENCE__WEIGHT_SYNC__BACKEND", "gloo")
    settings = load_settings(inference={"base_url": "http://127.0.0.1:9"})
    assert settings.inference.weight_sync == NcclWeightSync(backend="gloo")
    with WeightBroadcaster.from_settings(settings) as sender:  # no replica is touched before a sync
        assert (sender.backend, sender.urls, sender.group) == ("gloo", ["http://127.0.0.1:9"], None)
    with pytest.raises(SettingsError, match="backend"):
        load_settings(inference={"weight_sync": {"mode": "nccl", "backend": "mpi"}})


def test_a_replica_labelled_above_the_served_version_is_mid_sync_not_lagging():
    from services.weights.follower import lags

    assert not lags("4", 4) and not lags("5", 4)  # a broadcast labels before the version moves
    assert lags("3", 4) and lags("learn-k0@0", 4) and lags("", 4)


def test_from_settings_needs_the_nccl_choice():
    with pytest.raises(ValueError, match="inference.weight_sync is 's3'"):
        WeightBroadcaster.from_settings(load_settings())


def test_bad_group_arguments_are_refused():
    with pytest.raises(WeightProcessGroupError, match="choose one of nccl, gloo"):
        WeightProcessGroup("mpi", "127.0.0.1", 1, 0, 2)  # type: ignore[arg-type]
    with pytest.raises(WeightProcessGroupError, match="at least one replica"):
        WeightProcessGroup("gloo", "127.0.0.1", 1, 0, 1)
    with pytest.raises(WeightProcessGroupError, match="rank 2 of a weight group of 2"):
        WeightProcessGroup("gloo", "127.0.0.1", 1, 2, 2)


def _receiver(port: int, rank: int, world: int, out) -> None:
    group = WeightProcessGroup("gloo", "127.0.0.1", port, rank, world, timeout_s=60)
    try:
        got = [group.broadcast(torch.zeros(t.shape, dtype=t.dtype)) for _, t in SENT]
        out.put((rank, [t.tolist() for t in got]))
    finally:
        group.close()


def test_gloo_group_broadcasts_every_tensor_to_every_rank():
    """Rank 0 (this process) broadcasts tensors of three dtypes to two receiving processes."""
    ctx = multiprocessing.get_context("spawn")
    port, out = free_port(), ctx.Queue()
    procs = [ctx.Process(target=_receiver, args=(port, rank, 3, out)) for rank in (1, 2)]
    for p in procs:
        p.start()
    try:
        group = WeightProcessGroup("gloo", "127.0.0.1", port, 0, 3, timeout_s=60)
        try:
            for _, t in SENT:
                group.broadcast(t.clone())
            with pytest.raises(WeightProcessGroupError, match="tensor on meta"):
                group.broadcast(torch.empty(1, device="meta"))
        finally:
            group.close()
        received = dict(out.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert sorted(received) == [1, 2]
    for rank, tensors in received.items():
        assert tensors == [t.tolist() for _, t in SENT], rank
    assert [p.exitcode for p in procs] == [0, 0]


def test_buckets_are_runs_of_one_dtype_cut_at_the_byte_limit_in_order():
    f32, bf16 = torch.float32, torch.bfloat16
    assert bucket_layout([], []) == []
    assert bucket_layout([40, 40, 40], [f32] * 3, bucket_bytes=100) == [[0, 2], [2, 3]]
    assert bucket_layout([40, 40, 40], [f32, bf16, f32], bucket_bytes=1000) == [[0, 1], [1, 2], [2, 3]]
    assert bucket_layout([10, 500, 10, 10], [f32] * 4, bucket_bytes=100) == [[0, 1], [1, 2], [2, 4]]  # too big: alone
    layout = bucket_layout([8] * 50, [f32] * 25 + [bf16] * 25, bucket_bytes=64)
    assert [i for start, end in layout for i in range(start, end)] == list(range(50))
    assert all(end - start <= 8 for start, end in layout)


def test_sparse_checkpoints_are_refused_where_every_version_is_served_from_its_checkpoint():
    assert load_settings(inference={"weight_sync": "nccl"}).inference.weight_sync.checkpoint_every == 1
    assert load_settings(inference={"weight_sync": "nccl", "weight_sync_checkpoint_every": 4}) \
        .inference.weight_sync == NcclWeightSync(checkpoint_every=4)
    assert load_settings(inference={"weight_sync": {"mode": "nccl", "checkpoint_every": 4}}) \
        .inference.weight_sync == NcclWeightSync(checkpoint_every=4)
    with pytest.raises(SettingsError, match="inference.weight_sync.s3.checkpoint_every: Extra inputs are not permitted"):
        load_settings(inference={"weight_sync_checkpoint_every": 4})
    with pytest.raises(SettingsError, match="inference.weight_sync.s3.checkpoint_every: Extra inputs are not permitted"):
        load_settings(inference={"weight_sync": {"mode": "s3", "checkpoint_every": 4}})
    with pytest.raises(SettingsError, match="weight_sync_checkpoint_every and weight_sync.checkpoint_every are the same"):
        load_settings(inference={"weight_sync": {"mode": "nccl", "checkpoint_every": 2}, "weight_sync_checkpoint_every": 4})
