"""vLLM serving the tiny model: token-in/token-out, determinism, logprob agreement, health.

The ``slow`` tests read from the session's real vLLM server (CPU; ``served_model`` in
tests/conftest.py: the tiny model, seed 0, end-of-turn bias 4, 1,024 tokens, eager), which
they do not change; the others are fast unit tests of the launcher.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from pipeline_support import ServedModel

from services.cli.local_stack import free_port
from services.inference.server import InferenceServerError, VllmServer, build_command, check_inference, has_nvidia_gpu
from shared.settings import load_settings

SERVED = "tiny"
MESSAGES = [
    {"role": "system", "content": "Guess the secret number between 1 and 100."},
    {"role": "user", "content": "Your first guess?"},
]


# ---------------------------------------------------------------- fast: launcher only

def test_build_command_cpu_host() -> None:
    argv, env = build_command("/m", "tiny", port=8123, kv_cache_gib=2, gpu=False)
    assert argv[1] == "-m" and argv[2].startswith("vllm.entrypoints.")
    assert argv[argv.index("--model") + 1] == "/m"
    assert argv[argv.index("--port") + 1] == "8123"
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert not any(a.startswith("--gpu") for a in argv)


def test_eager_is_compiled_unless_asked_for_and_comes_from_settings() -> None:
    assert "--enforce-eager" not in build_command("/m", "tiny", gpu=False)[0]
    assert "--enforce-eager" in build_command("/m", "tiny", gpu=False, eager=True)[0]
    from services.inference.vllm_command import settings_options

    hub = {"model_path": "Qwen/Qwen2.5-0.5B-Instruct"}
    eager = load_settings(inference={**hub, "eager": True}).inference
    assert "--enforce-eager" in build_command(**settings_options(eager), gpu=True)[0]
    assert "--enforce-eager" not in build_command(**settings_options(load_settings(inference=hub).inference), gpu=True)[0]


def test_build_command_gpu_host() -> None:
    argv, env = build_command("/m", "tiny", gpu=True, dev_mode=False)
    assert "--gpu-memory-utilization" in argv
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and "VLLM_SERVER_DEV_MODE" not in env


def test_the_gpu_launch_takes_a_hub_name_tensor_parallelism_and_memory_share_from_settings() -> None:
    argv, _ = build_command("Qwen/Qwen2.5-7B-Instruct", "policy", gpu=True, dtype="bfloat16", tensor_parallel_size=2,
                            gpu_memory_utilization=0.6)
    for flag, value in (("--model", "Qwen/Qwen2.5-7B-Instruct"), ("--tensor-parallel-size", "2"),
                        ("--gpu-memory-utilization", "0.6"), ("--dtype", "bfloat16")):
        assert argv[argv.index(flag) + 1] == value, flag
    settings = load_settings(inference={"model_path": "Qwen/Qwen2.5-7B-Instruct", "tensor_parallel_size": 2,
                                        "gpu_memory_utilization": 0.6})
    if has_nvidia_gpu():
        server = VllmServer.from_settings(settings.inference)
        assert server.argv[server.argv.index("--tensor-parallel-size") + 1] == "2"
    else:  # settings reach the launcher: on a CPU host tensor parallelism is refused with the reason
        with pytest.raises(InferenceServerError, match=r"tensor parallelism \(2\) needs GPUs"):
            VllmServer.from_settings(settings.inference)


def test_check_inference_when_nothing_listens() -> None:
    status = check_inference(f"http://127.0.0.1:{free_port()}", timeout=1.0)
    assert status["ok"] is False and status["model"] is None and status["detail"]


def test_wait_ready_reports_log_tail_when_server_dies(tmp_path: Path) -> None:
    server = VllmServer(tmp_path / "no-such-model", port=free_port(), log_path=tmp_path / "v.log")
    server.argv = [sys.executable, "-c", "import sys; print('boom: bad model'); sys.exit(3)"]
    server.start()
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3.*boom: bad model"):
        server.wait_ready(timeout=30)
    assert server.health()["ok"] is False


# ---------------------------------------------------------------- slow: a real vLLM


@pytest.fixture(scope="module")
def server(served_model: ServedModel) -> VllmServer:
    assert served_model.vllm is not None  # started by this session's tiny_vllm
    return served_model.vllm


@pytest.fixture(scope="module")
def model_dir(served_model: ServedModel) -> Path:
    return served_model.model_dir


@pytest.fixture(scope="module")
def tok(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def prompt_ids(tok) -> list[int]:
    enc = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def _complete(server: VllmServer, prompt_ids: list[int], *, seed: int, max_tokens: int = 24,
              **extra: Any) -> dict[str, Any]:
    body = {"model": SERVED, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 1.0,
            "seed": seed, "logprobs": 0, "return_token_ids": True, **extra}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.slow
def test_token_in_token_out(server: VllmServer, tok, prompt_ids: list[int]) -> None:
    finished = set()
    for seed in range(8):
        choice = _complete(server, prompt_ids, seed=seed)
        assert choice["prompt_token_ids"] == prompt_ids
        ids = choice["token_ids"]
        assert 0 < len(ids) <= 24 and all(0 <= i < len(tok) for i in ids)
        logprobs = choice["logprobs"]["token_logprobs"]
        assert len(logprobs) == len(ids) and all(lp <= 0.0 for lp in logprobs)
        # vLLM's text holds back trailing bytes of an incomplete UTF-8 character, which a
        # full decode renders as U+FFFD: token ids, not text, are the source of truth.
        decoded = tok.decode(ids, skip_special_tokens=True)
        assert choice["text"].rstrip("\ufffd") == decoded.rstrip("\ufffd")
        finished.add(choice["finish_reason"])
        if choice["finish_reason"] == "stop":  # the eos is the last sampled id, not in the text
            assert ids[-1] == tok.eos_token_id and tok.eos_token_id not in ids[:-1]
        else:
            assert choice["finish_reason"] == "length" and len(ids) == 24
    assert finished <= {"stop", "length"}


@pytest.mark.slow
def test_same_seed_same_tokens(server: VllmServer, prompt_ids: list[int]) -> None:
    a = _complete(server, prompt_ids, seed=7, max_tokens=32, ignore_eos=True)
    b = _complete(server, prompt_ids, seed=7, max_tokens=32, ignore_eos=True)
    c = _complete(server, prompt_ids, seed=8, max_tokens=32, ignore_eos=True)
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 32
    assert a["logprobs"]["token_logprobs"] == b["logprobs"]["token_logprobs"]
    assert c["token_ids"] != a["token_ids"]


@pytest.mark.slow
def test_logprobs_match_transformers(server: VllmServer, model_dir: Path, prompt_ids: list[int]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    diffs = []
    for seed in range(3):
        choice = _complete(server, prompt_ids, seed=100 + seed, max_tokens=48, ignore_eos=True)
        sampled = choice["token_ids"]
        ids = torch.tensor([prompt_ids + sampled])
        with torch.no_grad():
            logprobs = model(ids).logits[0].log_softmax(-1)
        n = len(prompt_ids)
        ref = logprobs[n - 1 : n - 1 + len(sampled)].gather(1, torch.tensor(sampled)[:, None])[:, 0]
        diffs += (ref - torch.tensor(choice["logprobs"]["token_logprobs"])).abs().tolist()
    mad = sum(diffs) / len(diffs)
    print(f"vLLM vs transformers logprobs: mean abs diff {mad:.2e}, max {max(diffs):.2e} over {len(diffs)} tokens")
    assert mad < 1e-4
    assert max(diffs) < 1e-3


@pytest.mark.slow
def test_server_tokenizer_matches_local(server: VllmServer, tok) -> None:
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    text += '<tool_call>{"name": "guess", "arguments": {"number": 42}}</tool_call>'
    r = httpx.post(f"{server.base_url}/tokenize",
                   json={"model": SERVED, "prompt": text, "add_special_tokens": False}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tok.encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_health(server: VllmServer) -> None:
    status = server.health()
    assert status["ok"] is True and status["model"] == SERVED, status
    assert check_inference(server.base_url) == status
