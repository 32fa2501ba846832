"""LoRA training on CPU (issue 16, item 3): only the adapters train and the base weights never
move; the merged weights carry the base model's own names and equal the adapted model's
outputs; the training loop with ``trainer.lora`` writes checkpoints vLLM loads (merged full
weights, or the adapter alone) through a real S3 server (moto), and a restarted trainer resumes
the adapter and its optimizer state."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from services.trainer.checkpoints import (
    CheckpointError,
    download_checkpoint,
    read_manifest,
    resume,
    save_checkpoint,
    take_snapshot,
)
from services.trainer.lora import LoraShapeError, lora_shape, merged_state_dict, with_lora
from services.trainer.loop import TrainingLoop
from services.trainer.metrics import MetricsSink
from services.policy.model import frozen_reference, load_policy, sequence_logprobs
from services.trainer.step import PolicyTrainer
from services.policy.probe import LogprobProbe
from shared.names import CHECKPOINT_ADAPTER_CONFIG, CHECKPOINT_PROBE, batch_key, checkpoint_prefix
from shared.schemas import TrainingBatch
from shared.settings import LoraSettings, LossSettings, OptimSettings, Settings
from shared.state.staleness import StalenessBudget
from shared.storage import get_model
from test_trainer_checkpoints import _assert_same_optimizer_state, _Recording, store  # noqa: F401 (the S3 fixture)
from test_training_loop import queue_group
from model_layouts import policy_dir
from synthetic_logprobs import SYNTHETIC_LOGPROBS

LORA = LoraSettings(enabled=True, rank=4, alpha=8.0)
PROBE_IDS = torch.tensor([[1, 50, 60, 70, 80, 90, 100]])


def _logprobs(model: torch.nn.Module, ids: torch.Tensor = PROBE_IDS) -> torch.Tensor:
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = sequence_logprobs(model, ids, torch.ones_like(ids))
    model.train(was_training)
    return out


@pytest.mark.parametrize("layout", ["llama", "gpt2", "gpt_neox"])  # default targets: q/k/v/o, c_attn (a Conv1D), query_key_value
def test_lora_trains_only_the_adapters_and_merges_into_the_base_names(layout, tiny_dir, make_batch, tmp_path):
    base, tok = load_policy(tiny_dir if layout == "llama" else policy_dir(tmp_path / layout, layout))
    original = copy.deepcopy(base.state_dict())
    model = with_lora(copy.deepcopy(base), LORA)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    trainer = PolicyTrainer(model, tok.pad_token_id, alarm=SYNTHETIC_LOGPROBS, optim=OptimSettings(lr=2e-2))
    assert {id(p) for g in trainer.optimizer.param_groups for p in g["params"]} == {
        id(p) for p in model.parameters() if p.requires_grad}
    batches = [make_batch(seed, n=4, model=base, group_id=seed) for seed in range(2)]
    losses = [trainer.train_step(batches)["loss"] for _ in range(6)]
    assert losses[-1] < losses[0], losses

    merged = merged_state_dict(model)
    first_of_each_tensor = {t.data_ptr(): n for n, t in reversed(list(base.state_dict().items()))}
    assert set(merged) == set(first_of_each_tensor.values())  # the base model's own names, a tied head once
    changed = [n for n in merged if not torch.equal(merged[n], original[n])]
    targets = lora_shape(model)["target_modules"]
    assert changed and all(any(t in n for t in targets) for n in changed)
    for name, tensor in model.get_base_model().state_dict().items():  # the base weights never moved
        if "lora_" not in name:
            assert torch.equal(tensor, original[name.replace(".base_layer.", ".")]), name
    served = copy.deepcopy(base)
    loaded = served.load_state_dict(merged, strict=False)
    assert set(loaded.missing_keys) == set(original) - set(merged) and not loaded.unexpected_keys  # a tied head only
    torch.testing.assert_close(_logprobs(served), _logprobs(model), atol=1e-5, rtol=0)


def test_a_tied_output_head_is_merged_once(tmp_path):
    from services.inference.tiny_model import generate_tiny_model

    tied = generate_tiny_model(tmp_path / "tied", seed=0, layout="llama-tied")
    with safe_open(tied / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert set(merged_state_dict(with_lora(load_policy(tied)[0], LORA))) == names  # no lm_head.weight of its own


def test_a_target_module_the_model_lacks_is_refused_by_name(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match=r"target_modules \['qkv'\] name no linear layer of the model; it has .*'q_proj'"):
        with_lora(load_policy(tiny_dir)[0], LoraSettings(target_modules=["q_proj", "qkv"]))
    gpt2 = load_policy(policy_dir(tmp_path / "gpt2", "gpt2"))[0]
    with pytest.raises(ValueError, match=r"\['q_proj'\] name no linear layer.*peft's default for gpt2 is \['c_attn'\]"):
        with_lora(gpt2, LoraSettings(target_modules=["q_proj"]))  # named by the user: not replaced


@pytest.fixture
def lora_loop(tiny_dir, tmp_path, redis_client, redis_url, run_id, store):  # noqa: F811
    def make(trainer: dict | None = None, inference: dict | None = None, **lora) -> TrainingLoop:
        settings = Settings(
            run_id=run_id, redis={"url": redis_url}, inference={"model_path": tiny_dir, **(inference or {})},
            trainer={"max_off_policy_steps": 1, "groups_per_step": 2, "optim": {"lr": 1e-2},
                     "logprob_alarm": SYNTHETIC_LOGPROBS.model_dump(), "reward_curve_path": tmp_path / "curve.png",
                     "lora": {"enabled": True, "rank": 4, "alpha": 8.0, **lora}, **(trainer or {})},
        )
        budget = StalenessBudget(redis_client, run_id, 1, 2)
        return TrainingLoop(settings, store, budget, MetricsSink(tmp_path / "steps.jsonl"))

    return make


def _train_two_steps(loop: TrainingLoop, redis_client, store, make_batch, run_id) -> None:  # noqa: F811
    for version in range(2):
        for group in (2 * version, 2 * version + 1):
            queue_group(redis_client, store, make_batch, run_id, group, version)
        loop.train_once()


def test_the_loop_trains_the_adapter_serves_merged_weights_and_resumes(
        lora_loop, redis_client, store, make_batch, run_id, tiny_dir, tmp_path):  # noqa: F811
    loop = lora_loop()
    model = loop.trainer.model
    assert isinstance(model, PeftModel)
    optimized = [p for g in loop.trainer.optimizer.param_groups for p in g["params"]]
    assert optimized and {id(p) for p in optimized} == {id(p) for n, p in model.named_parameters() if "lora_" in n}
    base_logprobs = _logprobs(model)
    _train_two_steps(loop, redis_client, store, make_batch, run_id)
    assert loop.version == 2
    assert not torch.allclose(_logprobs(model), base_logprobs, atol=1e-4)  # the adapter learned something

    # what vLLM loads is a plain full checkpoint that answers as the adapted model does
    local = download_checkpoint(store, checkpoint_prefix(run_id, 2), tmp_path / "v2")
    assert CHECKPOINT_ADAPTER_CONFIG not in {p.name for p in local.iterdir()}
    served = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32)
    torch.testing.assert_close(_logprobs(served), _logprobs(model), atol=1e-5, rtol=0)
    probe = LogprobProbe.from_json((local / CHECKPOINT_PROBE).read_bytes())
    want = _logprobs(served, torch.tensor([probe.token_ids]))[0, 1:]
    assert max(abs(a - b) for a, b in zip(probe.logprobs, want.tolist())) < 1e-5
    assert read_manifest(store, checkpoint_prefix(run_id, 2))["lora"] == {
        "rank": 4, "alpha": 8.0, "target_modules": sorted(LORA.target_modules), "sync": "merged"}

    # a restarted trainer: the base from the served dir, the adapter and optimizer from the checkpoint
    restarted = lora_loop()
    assert (restarted.version, restarted.trainer.step) == (2, 2)
    for (name, a), b in zip(model.named_parameters(), restarted.trainer.model.parameters()):
        assert torch.equal(a, b), name
    _assert_same_optimizer_state(loop.trainer.optimizer.state_dict(), restarted.trainer.optimizer.state_dict())
    for group in (4, 5):
        queue_group(redis_client, store, make_batch, run_id, group, 2)
    restarted.train_once()
    loop.trainer.train_step([get_model(store, batch_key(run_id, g), TrainingBatch) for g in (4, 5)])
    for (name, a), b in zip(model.named_parameters(), restarted.trainer.model.parameters()):
        torch.testing.assert_close(b, a, atol=1e-7, rtol=0, msg=name)


def test_on_delta_the_chain_holds_the_merged_weights_each_checkpoint_serves(
        lora_loop, redis_client, store, make_batch, run_id):  # noqa: F811
    """``inference.weight_sync: delta`` with ``trainer.lora.sync: merged``: each chain version is
    the merged checkpoint, bit for bit, and a delta moves only the adapted matrices."""
    from safetensors.torch import load as load_safetensors

    from services.weights.delta import tensor_checksum
    from services.weights.delta_chain import ChainReader

    loop = lora_loop(inference={"weight_sync": {"mode": "delta", "delta_max_fraction": 1.0}})
    _train_two_steps(loop, redis_client, store, make_batch, run_id)
    reader = ChainReader(store, run_id)
    assert [(m.kind, m.base) for m in (reader.manifest(v) for v in (1, 2))] == [("full", None), ("delta", 1)]
    for version in (1, 2):
        checkpoint = load_safetensors(store.get_bytes(checkpoint_prefix(run_id, version) + "model.safetensors"))
        assert {name: tensor_checksum(t) for name, t in checkpoint.items()} == \
            {e.name: e.checksum for e in reader.manifest(version).tensors}
    moved = {e.name for e in reader.manifest(2).tensors if e.changed}
    assert moved and all(any(f".{m}.weight" in name for m in LORA.target_modules) for name in moved), moved


def test_adapter_sync_checkpoints_hold_the_adapter_alone(lora_loop, redis_client, store, make_batch, run_id,  # noqa: F811
                                                         tiny_dir, tmp_path):
    loop = lora_loop(sync="adapter")
    _train_two_steps(loop, redis_client, store, make_batch, run_id)
    local = download_checkpoint(store, checkpoint_prefix(run_id, 2), tmp_path / "v2")
    assert sorted(p.name for p in local.iterdir()) == ["adapter_config.json", "adapter_model.safetensors", CHECKPOINT_PROBE]
    served = PeftModel.from_pretrained(load_policy(tiny_dir)[0], local)  # peft's own loader, as vLLM reads it
    torch.testing.assert_close(_logprobs(served), _logprobs(loop.trainer.model), atol=1e-6, rtol=0)
    probe = LogprobProbe.from_json((local / CHECKPOINT_PROBE).read_bytes())
    want = _logprobs(served, torch.tensor([probe.token_ids]))[0, 1:]
    assert max(abs(a - b) for a, b in zip(probe.logprobs, want.tolist())) < 1e-5


def test_a_checkpoint_resumes_only_into_a_policy_of_its_kind(store, run_id, tiny_dir):  # noqa: F811
    model, tok = load_policy(tiny_dir)
    lora_model = with_lora(model, LORA)
    trainer = PolicyTrainer(lora_model, tok.pad_token_id, alarm=SYNTHETIC_LOGPROBS)
    save_checkpoint(store, run_id, 1, lora_model, tok, trainer.optimizer, 0)

    plain, _ = load_policy(tiny_dir)
    with pytest.raises(CheckpointError, match="run with LoRA; set trainer.lora.enabled: true to resume it"):
        resume(store, run_id, plain, PolicyTrainer(plain, tok.pad_token_id).optimizer)
    other = with_lora(load_policy(tiny_dir)[0], LoraSettings(rank=8, alpha=8.0))
    with pytest.raises(LoraShapeError, match="the checkpoint's adapter is .*'rank': 4.*the trainer's is .*'rank': 8"):
        resume(store, run_id, other, PolicyTrainer(other, tok.pad_token_id).optimizer)

    reading = _Recording(store)
    assert resume(reading, run_id, with_lora(load_policy(tiny_dir)[0], LORA), trainer.optimizer) == (1, 0)
    assert {k.rsplit("/", 1)[1] for k in reading.gets} == {"COMMITTED", "trainer_state.pt"}  # not the merged weights

    save_checkpoint(store, run_id, 2, plain, tok, PolicyTrainer(plain, tok.pad_token_id).optimizer, 0)
    with pytest.raises(CheckpointError, match="run without LoRA; set trainer.lora.enabled: false"):
        resume(store, run_id, lora_model, trainer.optimizer)


def test_a_lora_policy_has_no_snapshot(store, run_id, tiny_dir):  # noqa: F811
    """Snapshots serve only the nccl weight sync, which settings refuse with LoRA: a snapshot of
    a PeftModel (its own state dict, neither merged weights nor adapter) is refused, and nothing
    is written."""
    plain, tok = load_policy(tiny_dir)
    snapshot = take_snapshot(plain, PolicyTrainer(plain, tok.pad_token_id).optimizer, 1)
    lora_model = with_lora(load_policy(tiny_dir)[0], LORA)
    optimizer = PolicyTrainer(lora_model, tok.pad_token_id, alarm=SYNTHETIC_LOGPROBS).optimizer
    with pytest.raises(ValueError, match="snapshot of a LoRA policy is not supported"):
        take_snapshot(lora_model, optimizer, 1)
    with pytest.raises(ValueError, match="snapshot of a LoRA policy is not supported"):
        save_checkpoint(store, run_id, 1, lora_model, tok, optimizer, 0, snapshot=snapshot)
    assert store.list_keys(checkpoint_prefix(run_id, 1)) == []


def test_activation_checkpointing_still_trains_the_adapters(lora_loop, redis_client, store, make_batch, run_id):  # noqa: F811
    """The base is frozen: the checkpointed layers must still carry gradient to the adapters."""
    loop = lora_loop(trainer={"activation_checkpointing": True})
    before = {n: p.detach().clone() for n, p in loop.trainer.model.named_parameters() if p.requires_grad}
    for group in (0, 1):
        queue_group(redis_client, store, make_batch, run_id, group, 0)
    metrics = loop.train_once()
    assert metrics["grad_norm"] > 0
    moved = [n for n, p in loop.trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert sorted(moved) == sorted(n for n in before if "lora_B" in n)  # A's gradient is 0 while B is (peft's init)


def test_the_kl_reference_of_a_lora_policy_is_its_base_without_a_copy(tiny_dir, make_batch):
    base, tok = load_policy(tiny_dir)
    batches = [make_batch(seed, n=4, model=base, group_id=seed) for seed in range(2)]
    trainers = []
    for reference in (None, frozen_reference(base)):  # the base switched off inside, or a full frozen copy
        torch.manual_seed(0)  # the same adapter initialisation for both
        trainers.append(PolicyTrainer(with_lora(copy.deepcopy(base), LORA), tok.pad_token_id, reference=reference,
                                      alarm=SYNTHETIC_LOGPROBS, optim=OptimSettings(lr=2e-2), loss=LossSettings(kl_coef=0.5)))
    inside, copied = trainers
    assert inside.reference is None and inside.base_is_reference
    for _step in range(3):
        got, want = inside.train_step(batches), copied.train_step(batches)
        assert got["kl"] == pytest.approx(want["kl"], abs=1e-7) and got["loss"] == pytest.approx(want["loss"], abs=1e-6)
    assert want["kl"] > 1e-4  # the policy has left its reference
