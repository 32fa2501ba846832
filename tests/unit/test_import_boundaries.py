"""The trainer reaches inference only through the weights plane (``services.weights``): no module
under services/trainer/ imports ``services.inference``, at module level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imported_modules(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _imports_of(package: str, forbidden: str) -> dict[str, list[str]]:
    found = {}
    for path in sorted((ROOT / package.replace(".", "/")).rglob("*.py")):
        bad = sorted(n for n in _imported_modules(ast.parse(path.read_text()))
                     if n == forbidden or n.startswith(forbidden + "."))
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


def test_the_scan_sees_an_import_of_inference_in_any_form():
    source = ("import services.inference.server\n"
              "def f():\n    from services.inference import tiny_model\n"
              "from services.weights import sync\n")
    found = {n for n in _imported_modules(ast.parse(source)) if n.startswith("services.inference")}
    assert found == {"services.inference.server", "services.inference", "services.inference.tiny_model"}


def test_no_trainer_module_imports_services_inference():
    assert _imports_of("services.trainer", "services.inference") == {}


def test_the_weights_plane_takes_only_the_policy_model_from_the_trainer():
    """The trainer publishes into the weights plane (``services.trainer.broadcast_publish``), not
    the other way round: the weights plane's one use of trainer code is the policy model it
    loads to compute a logprob probe (``services.trainer.policy``)."""
    found = _imports_of("services.weights", "services.trainer")
    allowed = {"services.trainer.policy", "services.trainer.policy.load_policy", "services.trainer.policy.logprob_probe"}
    assert {path: [n for n in names if n not in allowed] for path, names in found.items()
            if set(names) - allowed} == {}
