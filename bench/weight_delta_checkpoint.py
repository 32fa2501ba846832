"""What the durable checkpoint costs a step on ``inference.weight_sync: delta``.

On delta the training loop writes each version's full checkpoint (``save_checkpoint``: the
weights in the trainer's dtype, and ``trainer_state.pt`` with AdamW's two moments) and only then
publishes the version to the chain (``DeltaPublisher``): the announcement, so every replica's
publish-to-served, waits for both. This measures the two on one Qwen2.5-shaped model (random
weights, fp32 master, served bf16) after one real AdamW step, into a local-disk object store
(``LocalStore``: no S3 server in the way, so the checkpoint figure is a lower bound; the S3 rates
are in docs/performance/training.md, "Weight sync at real model sizes").

    .venv/bin/python -m bench.weight_delta_checkpoint --size 0.5B --lr 1e-6
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bench.weight_delta_sizes import _model, _served
from services.inference.tiny_model import generate_tiny_model
from services.policy.model import logprob_probe
from services.trainer.checkpoints import save_checkpoint
from services.weights.delta_chain import ChainWriter
from shared.names import checkpoint_prefix
from shared.storage import LocalStore


def measure(size: str, lr: float, scratch: Path) -> dict[str, float]:
    tokenizer = AutoTokenizer.from_pretrained(generate_tiny_model(scratch / "tok"))  # only saved beside the weights
    store = LocalStore(scratch / "store")
    model = _model(size, torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    writer = ChainWriter(store, "bench", encoding="xor")
    writer.publish(0, _served(model))  # the full version the delta is taken against
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    t = time.perf_counter()
    probe = logprob_probe(model, 1)
    row = {"probe_s": time.perf_counter() - t}
    t = time.perf_counter()
    save_checkpoint(store, "bench", 1, model, tokenizer, optimizer, 1, probe=probe)
    row["checkpoint_s"] = time.perf_counter() - t
    prefix = checkpoint_prefix("bench", 1)
    row["checkpoint_mb"] = sum((store.root / k).stat().st_size for k in store.list_keys(prefix)) / 1e6
    t = time.perf_counter()
    served = _served(model)
    published = writer.publish(1, served, probe.to_json().decode())
    row["delta_publish_s"] = time.perf_counter() - t
    row["delta_encode_s"], row["delta_upload_s"] = published.encode_s, published.upload_s
    row["delta_mb"] = published.version.payload_size / 1e6
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="0.5B")
    parser.add_argument("--lr", type=float, default=1e-6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-delta-ckpt-") as tmp:
        row = measure(args.size, args.lr, Path(tmp))
    print(" ".join(f"{k}={v:.4g}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
