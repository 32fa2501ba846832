"""Fast tests of the tiny checkpoint: tokenizer, chat template, determinism, end-of-turn prior."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from services.inference.tiny_model import generate_tiny_model

MESSAGES = [
    {"role": "system", "content": "Guess the secret number."},
    {"role": "user", "content": "Guess a number between 1 and 100."},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0, end_of_turn_bias=4.0)


@pytest.fixture(scope="module")
def tok(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


def _ids(encoded) -> list[int]:
    """apply_chat_template(tokenize=True) returns a BatchEncoding in transformers 5."""
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def test_checkpoint_files_and_config(model_dir: Path, tok) -> None:
    for name in ["model.safetensors", "config.json", "generation_config.json",
                 "tokenizer.json", "tokenizer_config.json"]:
        assert (model_dir / name).is_file(), name
    config = AutoConfig.from_pretrained(model_dir)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.max_position_embeddings >= 1024
    assert config.hidden_size // config.num_attention_heads == 64
    assert config.vocab_size == len(tok), "every id the model can sample must decode"
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == eos == config.eos_token_id
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == eos
    assert tok.bos_token == tok.pad_token == "<|endoftext|>"


def test_chat_template(tok) -> None:
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nGuess the secret number.<|im_end|>\n"
        "<|im_start|>user\nGuess a number between 1 and 100.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = _ids(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True))
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(ids) == text
    no_prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)
    assert no_prompt.endswith("<|im_end|>\n")


def test_special_and_tool_tokens(tok) -> None:
    text = '<tool_call>{"name": "guess", "arguments": {"number": 42}}</tool_call>'
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<tool_call>")
    assert ids[-1] == tok.convert_tokens_to_ids("</tool_call>")
    # Tool-call tags are ordinary added tokens: they survive skip_special_tokens.
    assert tok.decode(ids, skip_special_tokens=True) == text
    eos = tok.eos_token_id
    assert tok.decode(ids + [eos], skip_special_tokens=True) == text
    assert tok.decode([eos]) == "<|im_end|>"
    for s in ["higher", "lower", "correct!", "0123456789", "My guess is 57."]:
        assert tok.decode(tok.encode(s, add_special_tokens=False)) == s
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)


def test_deterministic_per_seed(tmp_path: Path, model_dir: Path) -> None:
    a = generate_tiny_model(tmp_path / "a", seed=0, end_of_turn_bias=4.0)
    b = generate_tiny_model(tmp_path / "b", seed=1, end_of_turn_bias=4.0)
    for f in model_dir.iterdir():
        assert (a / f.name).read_bytes() == f.read_bytes(), f.name
    assert (b / "model.safetensors").read_bytes() != (a / "model.safetensors").read_bytes()
    assert (b / "tokenizer.json").read_bytes() == (a / "tokenizer.json").read_bytes()


def _mean_p_eos(model_dir: Path, tok) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    text += "My guess is 50. <tool_call>higher lower correct</tool_call> well done"
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        probs = model(ids).logits[0].softmax(-1)
    return probs[:, tok.eos_token_id].mean().item()


def test_end_of_turn_bias_raises_eos_probability(tmp_path: Path, model_dir: Path, tok) -> None:
    vocab = len(tok)
    p_biased = _mean_p_eos(model_dir, tok)
    p_plain = _mean_p_eos(generate_tiny_model(tmp_path / "plain", seed=0), tok)
    assert p_plain < 2 / vocab
    # bias 4 nats: measured ~0.04 per step (uniform would be 1/512 ~ 0.002)
    assert 10 / vocab < p_biased < 0.2, p_biased


def test_an_unknown_template_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny-model chat template 'qwen3'; choose one of chatml, reasoning"):
        generate_tiny_model(tmp_path / "m", template="qwen3")
    assert not (tmp_path / "m").exists()
