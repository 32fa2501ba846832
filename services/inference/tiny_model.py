"""A tiny random checkpoint that vLLM (CPU, float32) can serve, made on the spot.

No model hub is reachable, so tests and the demo use this instead of a real model.

Layouts (``LAYOUTS``), so every weight path is tested on more than one model family:
- ``llama``: ``LlamaForCausalLM``, separate ``lm_head.weight``, no biases;
- ``llama-tied``: the same with ``tie_word_embeddings: true`` (no ``lm_head.weight`` in the
  checkpoint: the output head is the input embedding, as in many small open models);
- ``qwen2``: ``Qwen2ForCausalLM`` with q/k/v projection biases and tied embeddings.

Invariants:
- ``generate_tiny_model(dir, seed, bias, layout)`` is a pure function of its arguments: the
  same arguments write byte-identical files (the tokenizer does not depend on the seed).
- The directory is a standard HF checkpoint in float32 safetensors,
  ``config.json``, ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``.
- Token ids: ``<|endoftext|>`` (bos/pad), ``<|im_start|>``, ``<|im_end|>`` (eos) are special;
  ``<tool_call>`` / ``</tool_call>`` are added, non-special tokens (they survive decoding).
  The model's vocab size equals the tokenizer's, so every sampled id decodes.
- ChatML template: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message,
  generation prompt ``<|im_start|>assistant\\n``.
- ``template`` picks the chat template (``TEMPLATES``), and nothing else: every other file is
  the same. ``chatml`` renders every message as it is (append-only). ``reasoning`` rewrites
  history as reasoning models' templates do (Qwen3's, for one): an assistant message before
  the last user message loses its reasoning, everything up to its last ``</think>`` and the
  newlines after it; the rest renders as in ``chatml``. Rendering a conversation that grew
  by a turn can then change text already rendered, so it is not a prefix of the new one.
- ``end_of_turn_bias`` is a property of the weights, not of sampling: hidden dimension 0
  carries a constant (1 in every embedding row, never written by attention or MLP
  outputs, and every embedding row has RMS exactly 1). After the final RMSNorm it is close
  to 1, and the lm_head row of ``<|im_end|>`` is the only row with a non-zero weight there,
  so its logit sits about ``end_of_turn_bias`` nats above the rest and turns end at
  varied lengths (measured: about 4% per step at temperature 1 with bias 4,
  against 1/512 for a uniform pick; turns then average ~20 tokens).
  In the tied layouts the head is the embedding, so the prior lives there: every row's dim 0
  is 1 and ``<|im_end|>``'s is ``1 + bias``, and content rows are scaled so that logits keep
  a spread of about ``LOGIT_STD``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS = PAD = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = EOS = "<|im_end|>"
SPECIAL_TOKENS = [BOS, IM_START, IM_END]
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]
VOCAB_SIZE = 512  # tokenizer size including special and added tokens

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The reasoning of an assistant message before the last user message is dropped (up to the
# last ``</think>``, then leading newlines), as reasoning models' templates do.
REASONING_CHAT_TEMPLATE = (
    "{% set state = namespace(last_user=-1) %}"
    "{% for message in messages %}{% if message['role'] == 'user' %}{% set state.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for message in messages %}"
    "{% set content = message['content'] or '' %}"
    "{% if message['role'] == 'assistant' and loop.index0 < state.last_user and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEMPLATES = {"chatml": CHAT_TEMPLATE, "reasoning": REASONING_CHAT_TEMPLATE}

HIDDEN = 128
HEADS = 2
KV_HEADS = 1
LAYERS = 2
INTERMEDIATE = 256
MAX_POSITIONS = 2048
LOGIT_STD = 1.0  # spread of the content part of the logits
TIED_PRIOR_SCALE = 0.6  # tied: the final hidden state's dim 0 is larger (content rows are small)


def _corpus() -> list[str]:
    """A fixed corpus: chat turns, numbers, guessing-game talk and tool-call JSON."""
    rng = random.Random(1234)
    words = (
        "the a is it my your number guess think try again between and to of you I "
        "higher lower correct wrong close far too high low yes no good great well done "
        "please next what which answer game start end turn round secret pick from one "
        "hundred ten user assistant system tool call result name arguments value is"
    ).split()
    lines = []
    for _ in range(600):
        n = rng.randint(0, 100)
        lines.append(f'<tool_call>{{"name": "guess", "arguments": {{"number": {n}}}}}</tool_call>')
        lines.append(f"My guess is {n}. " + rng.choice(["Higher.", "Lower.", "Correct!", "higher", "lower", "correct"]))
        lines.append(f"{IM_START}user\nGuess a number between 1 and 100.{IM_END}\n")
        lines.append(f"{IM_START}assistant\n" + " ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + f"{IM_END}\n")
        lines.append(f"{IM_START}tool\n" + rng.choice(["higher", "lower", "correct"]) + f"{IM_END}\n")
        lines.append(" ".join(str(rng.randint(0, 9999)) for _ in range(4)))
    return lines


def _train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TOOL_TOKENS),
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tok


LAYOUTS = ("llama", "llama-tied", "qwen2")


def _weights(vocab: int, eos_id: int, seed: int, end_of_turn_bias: float, layout: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tied = layout != "llama"

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32) * std

    # Embedding rows: dim 0 = 1 (the constant channel), dims 1.. a random direction with
    # norm sqrt(H - 1), so every row has RMS exactly 1 (untied); tied, the content part is
    # scaled to give logits of spread LOGIT_STD, and the end-of-turn prior sits in dim 0.
    content = randn(vocab, HIDDEN - 1, std=1.0)
    content = content / content.norm(dim=1, keepdim=True) * (HIDDEN - 1) ** 0.5
    if tied:
        content = content * LOGIT_STD / HIDDEN**0.5
    embed = torch.cat([torch.ones(vocab, 1), content], dim=1)
    if tied:
        embed[eos_id, 0] += end_of_turn_bias * TIED_PRIOR_SCALE

    head_dim = HIDDEN // HEADS
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        o_proj = randn(HIDDEN, HEADS * head_dim, std=0.5 / (HEADS * head_dim) ** 0.5)
        down = randn(HIDDEN, INTERMEDIATE, std=0.5 / INTERMEDIATE**0.5)
        o_proj[0].zero_()  # the residual stream's dim 0 is never written: it stays 1
        down[0].zero_()
        sd.update({
            p + "self_attn.q_proj.weight": randn(HEADS * head_dim, HIDDEN, std=HIDDEN**-0.5),
            p + "self_attn.k_proj.weight": randn(KV_HEADS * head_dim, HIDDEN, std=HIDDEN**-0.5),
            p + "self_attn.v_proj.weight": randn(KV_HEADS * head_dim, HIDDEN, std=HIDDEN**-0.5),
            p + "self_attn.o_proj.weight": o_proj,
            **({
                p + "self_attn.q_proj.bias": randn(HEADS * head_dim, std=0.1),
                p + "self_attn.k_proj.bias": randn(KV_HEADS * head_dim, std=0.1),
                p + "self_attn.v_proj.bias": randn(KV_HEADS * head_dim, std=0.1),
            } if layout == "qwen2" else {}),
            p + "mlp.gate_proj.weight": randn(INTERMEDIATE, HIDDEN, std=HIDDEN**-0.5),
            p + "mlp.up_proj.weight": randn(INTERMEDIATE, HIDDEN, std=HIDDEN**-0.5),
            p + "mlp.down_proj.weight": down,
            p + "input_layernorm.weight": torch.ones(HIDDEN),
            p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
        })
    sd["model.norm.weight"] = torch.ones(HIDDEN)
    if tied:
        return {k: v.contiguous() for k, v in sd.items()}
    # Final hidden state has RMS ~1, so a row with std s gives logits with std ~s*sqrt(H).
    lm_head = randn(vocab, HIDDEN, std=LOGIT_STD / HIDDEN**0.5)
    lm_head[:, 0] = 0.0
    # <|im_end|>'s logit is the prior alone: bias times dim 0 (~1 after the final norm).
    lm_head[eos_id] = 0.0
    lm_head[eos_id, 0] = end_of_turn_bias
    sd["lm_head.weight"] = lm_head
    return {k: v.contiguous() for k, v in sd.items()}


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _config(layout: str, vocab: int, bos_id: int, eos_id: int) -> dict:
    common = {
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": layout != "llama",
        "dtype": "float32",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": bos_id,
    }
    if layout == "qwen2":  # q/k/v biases are implied by the architecture
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **common,
                "use_sliding_window": False, "max_window_layers": LAYERS}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
            "head_dim": HIDDEN // HEADS, "attention_bias": False, "mlp_bias": False}


def generate_tiny_model(out_dir: Path, seed: int = 0, end_of_turn_bias: float = 0.0, layout: str = "llama",
                        template: str = "chatml") -> Path:
    """Write the tiny checkpoint of ``layout`` (see ``LAYOUTS``) with the chat template
    ``template`` (see ``TEMPLATES``) to ``out_dir`` and return it."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown tiny-model layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    if template not in TEMPLATES:
        raise ValueError(f"unknown tiny-model chat template {template!r}; choose one of {', '.join(TEMPLATES)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer()
    vocab = tok.get_vocab_size(with_added_tokens=True)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    bos_id, eos_id = ids[BOS], ids[IM_END]
    if bos_id is None or eos_id is None:
        raise RuntimeError(f"the trained tokenizer lacks {BOS!r} or {IM_END!r}: SPECIAL_TOKENS must hold both")

    save_file(_weights(vocab, eos_id, seed, end_of_turn_bias, layout), str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    _write_json(out_dir / "config.json", {
        **_config(layout, vocab, bos_id, eos_id),
        "conveyor_tiny": {"seed": seed, "end_of_turn_bias": end_of_turn_bias, "layout": layout},
    })
    # Only token ids here: sampling defaults in generation_config.json would silently
    # become vLLM's server-side defaults.
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": bos_id,
    })
    tok.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": IM_END,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": TEMPLATES[template],
    })
    return out_dir
