"""LoRA training on CPU (issue 16, item 3, in part): only the adapters train and the base weights
never move; steps on a fixed batch lower the loss; the merged weights carry the base model's own
names and equal the adapted model's outputs, so the S3 weight path can serve them unchanged."""

from __future__ import annotations

import copy

import torch

from services.trainer.lora import merged_state_dict, with_lora
from services.trainer.policy import load_policy, sequence_logprobs
from services.trainer.step import PolicyTrainer
from shared.settings import LogprobAlarmSettings, OptimSettings

SYNTHETIC_LOGPROBS = LogprobAlarmSettings(max_on_policy_mad=1e6)  # make_batch's logprobs are not the model's


def test_lora_trains_only_the_adapters_and_merges_into_the_base_names(tiny_dir, make_batch):
    base, tok = load_policy(tiny_dir)
    original = copy.deepcopy(base.state_dict())
    model = with_lora(copy.deepcopy(base), rank=4, alpha=8.0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    trainer = PolicyTrainer(model, tok.pad_token_id, alarm=SYNTHETIC_LOGPROBS, optim=OptimSettings(lr=2e-2))
    assert {id(p) for g in trainer.optimizer.param_groups for p in g["params"]} == {
        id(p) for p in model.parameters() if p.requires_grad}
    batches = [make_batch(seed, n=4, model=base, group_id=seed) for seed in range(2)]
    losses = [trainer.train_step(batches)["loss"] for _ in range(6)]
    assert losses[-1] < losses[0], losses

    merged = merged_state_dict(model)
    assert set(merged) == set(original)  # the base model's own names: a plain checkpoint
    changed = [n for n in merged if not torch.equal(merged[n], original[n])]
    assert changed and all(any(t in n for t in ("q_proj", "k_proj", "v_proj", "o_proj")) for n in changed)
    for name, tensor in model.get_base_model().state_dict().items():  # the base weights never moved
        if "lora_" not in name:
            assert torch.equal(tensor, original[name.replace(".base_layer.", ".")]), name
    served = copy.deepcopy(base)
    served.load_state_dict(merged)
    ids = torch.tensor([[1, 50, 60, 70, 80]])
    with torch.no_grad():
        expected = sequence_logprobs(model.eval(), ids, torch.ones_like(ids))
        got = sequence_logprobs(served.eval(), ids, torch.ones_like(ids))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
