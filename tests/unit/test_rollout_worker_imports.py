"""A rollout worker process does not import torch: not with its Celery task module, not when it
loads the policy's tokenizer (``tokenizer_loading``), which is still the tokenizer
``AutoTokenizer`` builds. torch costs about 360 MB of resident memory per worker process.

Each check runs in a fresh interpreter, so that nothing this test process imported counts.

The rollout worker's image (conveyor/worker, compose/images/conveyor) holds no torch, peft or vLLM
(``image_wheels.worker_requirements``). The last two tests: no module of
``services.rollout_worker`` or ``shared`` imports a package the service image has and the worker
image lacks, even inside a function; and the worker's entry points run in an interpreter where
those packages cannot be imported, as in that image: the ``conveyor`` command, the Celery task
module, every module of those two packages, the environments' start-up check and the tokenizer.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from services.cli.image_wheels import runtime_requirements, worker_requirements
from services.inference.tiny_model import generate_tiny_model


def _run(code: str, *args: str, env: dict[str, str] | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_the_rollout_task_module_does_not_import_torch():
    loaded = _run("import json, sys\nimport services.rollout_worker.tasks\n"
                  "print(json.dumps({'torch': sorted(m for m in sys.modules if m.split('.')[0] == 'torch')}))")
    assert loaded["torch"] == []


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return generate_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")


def test_the_worker_tokenizer_is_autotokenizers_and_loads_without_torch(model_dir):
    from transformers import AutoTokenizer  # this process may import torch; the worker's may not

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


def _modules_the_worker_image_lacks() -> list[str]:
    """Top-level modules whose every distribution is in the service image's closure and not in
    the worker image's."""
    def names(lines: list[str]) -> set[str]:
        return {canonicalize_name(re.split(r"[=<>!~;\[ ]", line, maxsplit=1)[0]) for line in lines}

    lacking = names(runtime_requirements()) - names(worker_requirements())
    return sorted(module for module, dists in packages_distributions().items()
                  if {canonicalize_name(d) for d in dists} <= lacking)


def _imported_top_levels(package_dirs: list[Path]) -> dict[str, set[str]]:
    """Every module's imports, at module level or inside a function, as top-level names."""
    found: dict[str, set[str]] = {}
    for path in (p for d in package_dirs for p in d.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found.setdefault(str(path), set()).update(name.split(".")[0] for name in names)
    return found


def test_no_worker_module_imports_a_package_the_worker_image_lacks_even_lazily():
    root = Path(__file__).resolve().parents[2]
    lacking = set(_modules_the_worker_image_lacks())
    imports = _imported_top_levels([root / "services" / "rollout_worker", root / "shared"])
    assert {path: names & lacking for path, names in imports.items() if names & lacking} == {}


# Run where the worker image's missing packages cannot be imported: walk services.rollout_worker
# and shared (an ImportError of a missing dev-only package is not the image's concern), load the
# CLI and the task module, check the demo environments' start-up and load the tokenizer.
WORKER_ENTRY_POINTS = """
import importlib, json, pkgutil, sys
blocked = set(json.loads(sys.argv[2]))
needs = {}
for package in ("services.rollout_worker", "shared"):
    for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
        try:
            importlib.import_module(info.name)
        except ImportError as exc:
            if (exc.name or "").split(".")[0] in blocked:
                needs[info.name] = exc.name
import services.cli.app, services.rollout_worker.tasks
from services.cli.preflight import check_environments
from shared.settings import Settings
check_environments(Settings())
check_environments(Settings(intake={"env_name": "single_turn",
                                    "env_config": {"reward_fn": "services.rollout_worker.environments.toy_rewards:digit_share"}}))
from services.rollout_worker.chat_tokens import load_chat_tokens
chat = load_chat_tokens(sys.argv[1])
print(json.dumps({"needs": needs, "loaded": sorted(m for m, mod in sys.modules.items() if mod is not None and m.split(".")[0] in blocked),
                  "tokens": chat.observation_ids("lower", True)}))
"""


def test_the_worker_runs_with_only_the_worker_images_packages(model_dir, tmp_path):
    from transformers import AutoTokenizer

    from services.rollout_worker.chat_tokens import ChatTokens

    lacking = _modules_the_worker_image_lacks()
    assert {"torch", "vllm", "peft"} <= set(lacking), lacking
    site = tmp_path / "site"  # inherited by the tokenizer's class-naming subprocess too
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import sys\nfor name in {lacking!r}:\n    sys.modules[name] = None\n")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(root)])}
    worker = _run(WORKER_ENTRY_POINTS, str(model_dir), json.dumps(lacking), env=env)
    assert worker["needs"] == {} and worker["loaded"] == [], worker
    assert worker["tokens"] == ChatTokens(AutoTokenizer.from_pretrained(str(model_dir))).observation_ids("lower", True)
    help_text = subprocess.run([sys.executable, "-m", "services.cli.app", "worker", "rollout", "--help"], env=env,
                               capture_output=True, text=True, timeout=120)
    assert help_text.returncode == 0 and "rollout worker" in help_text.stdout, help_text.stderr[-2000:]
