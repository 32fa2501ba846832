"""Checkpoints through a real S3 server (moto): round trip, commit marker, and trainer resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from services.trainer.checkpoints import (
    COMMITTED,
    TRAINER_STATE,
    CheckpointError,
    checkpoint_prefix,
    download_checkpoint,
    latest_checkpoint,
    read_manifest,
    resume,
    save_checkpoint,
    take_snapshot,
)
from services.policy.model import load_policy
from services.trainer.step import PolicyTrainer
from services.policy.probe import LogprobProbe, probe_token_ids
from shared.names import CHECKPOINT_PROBE
from shared.settings import OptimSettings
from shared.settings import S3StorageSettings
from shared.storage import S3Store
from synthetic_logprobs import SYNTHETIC_LOGPROBS

# make_batch's inference logprobs are deliberately not the model's own (noise, or random
# values), so the on-policy logprob alarm would fire on them: these tests turn it off.


@pytest.fixture
def store(s3_endpoint: str) -> S3Store:
    s3 = S3Store(S3StorageSettings(endpoint=s3_endpoint, access_key="testing", secret_key="testing", bucket="ckpt"))
    s3.ensure_bucket()
    return s3


class _Recording:
    """The store, remembering the order of writes, and the reads."""

    def __init__(self, inner: S3Store):
        self.inner = inner
        self.puts: list[str] = []
        self.gets: list[str] = []

    def put_bytes(self, key: str, data: bytes) -> None:
        self.puts.append(key)
        self.inner.put_bytes(key, data)

    def get_bytes(self, key: str) -> bytes:
        self.gets.append(key)
        return self.inner.get_bytes(key)

    def list_keys(self, prefix: str) -> list[str]:
        return self.inner.list_keys(prefix)


def _trainer(model_dir: Path) -> tuple[PolicyTrainer, object]:
    model, tok = load_policy(model_dir)
    return PolicyTrainer(model, tok.pad_token_id, alarm=SYNTHETIC_LOGPROBS, optim=OptimSettings(lr=1e-3, weight_decay=0.01)), tok


def _assert_same_optimizer_state(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys() and a["state"]
    for key in a["state"]:
        for name, value in a["state"][key].items():
            torch.testing.assert_close(b["state"][key][name], value, atol=0, rtol=0)


def test_round_trip_through_s3(store: S3Store, run_id: str, tiny_dir: Path, make_batch, tmp_path: Path) -> None:
    trainer, tok = _trainer(tiny_dir)
    trainer.train_step([make_batch(0, model=trainer.model)])
    recording = _Recording(store)
    prefix = save_checkpoint(recording, run_id, 1, trainer.model, tok, trainer.optimizer, trainer.step)
    assert prefix == f"checkpoints/{run_id}/000001/"
    written = [k.removeprefix(prefix) for k in recording.puts]
    assert written[0] == "model.safetensors" and written[-1] == COMMITTED  # weights first, marker last
    assert latest_checkpoint(store, run_id) == (1, prefix)

    local = download_checkpoint(store, prefix, tmp_path / "v1")
    names = {p.name for p in local.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert TRAINER_STATE not in names  # what vLLM loads carries no optimizer state
    # the same architecture vLLM serves, and no sampling defaults smuggled into generation_config
    assert AutoConfig.from_pretrained(local).to_dict()["architectures"] == ["LlamaForCausalLM"]
    assert AutoConfig.from_pretrained(local).vocab_size == AutoConfig.from_pretrained(tiny_dir).vocab_size
    generation = json.loads((local / "generation_config.json").read_text())
    assert not {"temperature", "top_p", "top_k", "do_sample"} & generation.keys()
    loaded = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32)
    for (name, a), b in zip(trainer.model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    text = "<|im_start|>user\nGuess a number<|im_end|>\n"
    assert AutoTokenizer.from_pretrained(local)(text)["input_ids"] == tok(text)["input_ids"]

    manifest = read_manifest(store, prefix)
    assert manifest["version"] == 1 and manifest["step"] == 1 and TRAINER_STATE in manifest["files"]

    # the probe a replica must reproduce: the saved weights' own logprobs of the fixed sequence
    probe = LogprobProbe.from_json((local / CHECKPOINT_PROBE).read_bytes())
    assert probe.version == 1 and probe.token_ids == probe_token_ids(loaded.config.vocab_size)
    ids = torch.tensor([probe.token_ids])
    with torch.no_grad():
        want = torch.log_softmax(loaded(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    assert max(abs(a - b) for a, b in zip(probe.logprobs, want.tolist())) < 1e-5


def test_a_snapshot_checkpoint_holds_the_snapshot_not_the_later_weights(store: S3Store, run_id: str, tiny_dir: Path,
                                                                        make_batch, tmp_path: Path) -> None:
    """The nccl path writes checkpoint v in the background while step v + 1 trains: it must
    hold what was broadcast as v (weights, optimizer state, probe), not the newer values."""
    trainer, tok = _trainer(tiny_dir)
    trainer.train_step([make_batch(0, model=trainer.model)])
    weights_v1 = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    optimizer_v1 = {"param_groups": trainer.optimizer.state_dict()["param_groups"],
                    "state": {k: {n: t.clone() for n, t in v.items()} for k, v in trainer.optimizer.state_dict()["state"].items()}}
    snapshot = take_snapshot(trainer.model, trainer.optimizer, 1)
    trainer.train_step([make_batch(1, model=trainer.model)])  # step 2 changes weights and moments in place
    assert not torch.equal(trainer.model.state_dict()["lm_head.weight"], weights_v1["lm_head.weight"])
    with pytest.raises(ValueError, match="snapshot of version 1 saved as version 2"):
        save_checkpoint(store, run_id, 2, trainer.model, tok, trainer.optimizer, 1, snapshot=snapshot)

    prefix = save_checkpoint(store, run_id, 1, trainer.model, tok, trainer.optimizer, 1, snapshot=snapshot)
    local = download_checkpoint(store, prefix, tmp_path / "v1", with_trainer_state=True)
    loaded = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, weights_v1[name]), name
    _assert_same_optimizer_state(optimizer_v1, torch.load(local / TRAINER_STATE, weights_only=True)["optimizer"])
    assert LogprobProbe.from_json((local / CHECKPOINT_PROBE).read_bytes()) == snapshot.probe


def test_uncommitted_checkpoints_do_not_exist_for_readers(store: S3Store, run_id: str, tiny_dir: Path, tmp_path: Path) -> None:
    trainer, tok = _trainer(tiny_dir)
    assert latest_checkpoint(store, run_id) is None
    save_checkpoint(store, run_id, 2, trainer.model, tok, trainer.optimizer, 0)
    half = checkpoint_prefix(run_id, 3)
    store.put_bytes(half + "model.safetensors", b"half a checkpoint")  # a trainer died mid-upload
    assert latest_checkpoint(store, run_id) == (2, checkpoint_prefix(run_id, 2))
    with pytest.raises(CheckpointError, match="not committed"):
        download_checkpoint(store, half, tmp_path / "v3")
    with pytest.raises(CheckpointError, match="already committed"):
        save_checkpoint(store, run_id, 2, trainer.model, tok, trainer.optimizer, 0)
    # a file that changed after commit is caught
    store.put_bytes(checkpoint_prefix(run_id, 2) + "config.json", b"{}")
    with pytest.raises(CheckpointError, match="manifest"):
        download_checkpoint(store, checkpoint_prefix(run_id, 2), tmp_path / "v2")


def test_resume_restores_step_optimizer_and_the_next_update(store: S3Store, run_id: str, tiny_dir: Path, make_batch) -> None:
    batches = [[make_batch(seed, n=3, model=load_policy(tiny_dir)[0], group_id=seed)] for seed in range(3)]

    uninterrupted, tok = _trainer(tiny_dir)
    uninterrupted.train_step(batches[0])
    uninterrupted.train_step(batches[1])
    save_checkpoint(store, run_id, 2, uninterrupted.model, tok, uninterrupted.optimizer, uninterrupted.step)
    saved_optimizer = {"state": {k: {n: v.clone() for n, v in s.items()} for k, s in uninterrupted.optimizer.state_dict()["state"].items()},
                       "param_groups": uninterrupted.optimizer.state_dict()["param_groups"]}
    uninterrupted.train_step(batches[2])

    restarted, _ = _trainer(tiny_dir)  # a new process: fresh weights from the served dir
    assert resume(store, run_id, restarted.model, restarted.optimizer) == (2, 2)
    restarted.step = 2
    _assert_same_optimizer_state(saved_optimizer, restarted.optimizer.state_dict())
    restarted.train_step(batches[2])
    assert restarted.step == uninterrupted.step == 3
    for (name, a), b in zip(uninterrupted.model.named_parameters(), restarted.model.parameters()):
        torch.testing.assert_close(b, a, atol=1e-7, rtol=0, msg=name)


def test_resume_without_checkpoint_changes_nothing(store: S3Store, run_id: str, tiny_dir: Path) -> None:
    trainer, _ = _trainer(tiny_dir)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    assert resume(store, run_id, trainer.model, trainer.optimizer) == (0, 0)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
