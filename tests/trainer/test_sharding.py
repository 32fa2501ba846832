"""FSDP2 over 2 processes with the gloo backend (issue 16, item 2), on CPU: the sharded step's
loss, gradient norm and updated weights equal the unsharded step's on the same batch (with an
odd number of token-budget micro-batches, so one rank runs a masked pass), and a sharded
checkpoint written by each rank reads back into fresh sharded models unchanged."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from model_layouts import policy_dir

from services.cli.local_stack import free_port
from services.trainer.batching import micro_batches, prepare_samples
from services.policy.model import load_policy
from services.trainer.step import PolicyTrainer, build_optimizer
from shared.schemas import TrainingBatch
from shared.settings import BatchingSettings, OptimSettings
from synthetic_logprobs import SYNTHETIC_LOGPROBS

WORLD = 2
OPTIM = OptimSettings(lr=1e-3, max_grad_norm=1.0)
BATCHING = BatchingSettings(max_seq_len=32, micro_batch_tokens=40)


def _rank(rank: int, tiny_dir: str, batches_path: str, out_dir: str, port: int) -> None:
    import torch.distributed as dist

    from services.trainer.distributed import exit_rank_process
    from services.trainer.sharding import full_state_dict, load_sharded, save_sharded, shard_policy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        batches = [TrainingBatch.model_validate_json(line) for line in Path(batches_path).read_text().splitlines()]
        model, tok = load_policy(tiny_dir)
        shard_policy(model)
        trainer = PolicyTrainer(model, tok.pad_token_id, alarm=SYNTHETIC_LOGPROBS, optim=OPTIM, batching=BATCHING)
        metrics = trainer.train_step(batches)
        stepped = full_state_dict(model)
        save_sharded(model, trainer.optimizer, Path(out_dir) / "sharded")
        fresh, _ = load_policy(tiny_dir)
        shard_policy(fresh)
        optimizer = build_optimizer(fresh, OPTIM)
        load_sharded(fresh, optimizer, Path(out_dir) / "sharded")
        reloaded = full_state_dict(fresh)
        if rank == 0:
            torch.save({"metrics": metrics, "stepped": stepped, "reloaded": reloaded}, Path(out_dir) / "rank0.pt")
    finally:
        dist.destroy_process_group()
    exit_rank_process()  # as the trainer's ranks end: no interpreter shutdown for gloo's threads to abort


@pytest.mark.timeout(600)
# qwen2: attention biases and a head tied to the embedding; gpt2 and gpt_neox: other module
# trees (transformer.h, gpt_neox.layers), fused attention projections, absolute positions (gpt2)
@pytest.mark.parametrize("layout", ["llama", "qwen2", "gpt2", "gpt_neox"])
def test_a_sharded_step_over_two_gloo_processes_equals_the_unsharded_step(layout, make_batch, tmp_path):
    tiny_dir = policy_dir(tmp_path / "tiny", layout)
    model, tok = load_policy(tiny_dir)
    batches = [make_batch(seed, n=4, model=model, group_id=seed) for seed in range(3)]
    prepared = prepare_samples([s for b in batches for s in b.samples], BATCHING)
    count = len(micro_batches(prepared.samples, BATCHING.micro_batch_tokens, tok.pad_token_id))
    assert count >= 3 and count % WORLD == 1, f"{count} micro-batches: the test wants an odd number"
    batches_path = tmp_path / "batches.jsonl"
    batches_path.write_text("".join(b.model_dump_json() + "\n" for b in batches))

    mp.start_processes(_rank, args=(str(tiny_dir), str(batches_path), str(tmp_path), free_port()), nprocs=WORLD,
                       start_method="spawn", join=True)
    sharded = torch.load(tmp_path / "rank0.pt", weights_only=False)

    unsharded = PolicyTrainer(copy.deepcopy(model), tok.pad_token_id, alarm=SYNTHETIC_LOGPROBS, optim=OPTIM, batching=BATCHING)
    expected = unsharded.train_step(batches)
    for key in ("loss", "grad_norm", "tokens", "loss_tokens", "clip_frac", "logprob_mad_vs_inference"):
        assert sharded["metrics"][key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    weights = dict(unsharded.model.state_dict())
    for name, value in sharded["stepped"].items():
        torch.testing.assert_close(value, weights[name], atol=2e-6, rtol=1e-5, msg=name)
    embedding = next(name for name, p in model.named_parameters() if p is model.get_input_embeddings().weight)
    assert not torch.equal(sharded["stepped"][embedding], model.state_dict()[embedding])
    for name, value in sharded["reloaded"].items():  # the sharded checkpoint round trip
        torch.testing.assert_close(value, sharded["stepped"][name], atol=0, rtol=0, msg=name)
