"""A rollout worker process does not import torch: not with its Celery task module, not when it
loads the policy's tokenizer (``tokenizer_loading``), which is still the tokenizer
``AutoTokenizer`` builds. torch costs about 360 MB of resident memory per worker process.

Each check runs in a fresh interpreter, so that nothing this test process imported counts.
"""

from __future__ import annotations

import json
import subprocess
import sys

from services.inference.tiny_model import generate_tiny_model


def _run(code: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_the_rollout_task_module_does_not_import_torch():
    loaded = _run("import json, sys\nimport services.rollout_worker.tasks\n"
                  "print(json.dumps({'torch': sorted(m for m in sys.modules if m.split('.')[0] == 'torch')}))")
    assert loaded["torch"] == []


def test_the_worker_tokenizer_is_autotokenizers_and_loads_without_torch(tmp_path):
    from transformers import AutoTokenizer  # this process may import torch; the worker's may not

    model_dir = generate_tiny_model(tmp_path / "tiny")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say a number."}]
    worker_side = _run(
        "import json, sys\nfrom services.rollout_worker.chat_tokens import load_chat_tokens\n"
        "chat = load_chat_tokens(sys.argv[1])\nmessages = json.loads(sys.argv[2])\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'class': type(chat.tokenizer).__qualname__,\n"
        "                  'prompt': chat.initial_prompt(messages), 'observation': chat.observation_ids('lower', True)}))",
        str(model_dir), json.dumps(messages))
    from services.rollout_worker.chat_tokens import ChatTokens

    reference = ChatTokens(AutoTokenizer.from_pretrained(str(model_dir)))
    assert worker_side == {"torch": False, "class": type(reference.tokenizer).__qualname__,
                           "prompt": reference.initial_prompt(messages),
                           "observation": reference.observation_ids("lower", True)}
