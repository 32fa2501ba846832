"""Imports run down the data flow, at module level or inside a function: ``shared`` imports
nothing of ``services``; the trainer reaches inference only through the weights plane
(``services.weights``), the weights plane imports no trainer code, and the policy model
(``services.policy``) imports none of the three. (A built-in environment named by its
``module:Class`` string in ``shared.environments.registry`` is a plug-in path, imported when
chosen, not an import of ``shared``.)"""

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


def _forbidden_in(source: str, forbidden: str) -> list[str]:
    return sorted(n for n in _imported_modules(ast.parse(source)) if n == forbidden or n.startswith(forbidden + "."))


def _imports_of(package: str, forbidden: str) -> dict[str, list[str]]:
    found = {}
    for path in sorted((ROOT / package.replace(".", "/")).rglob("*.py")):
        bad = _forbidden_in(path.read_text(), forbidden)
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


def test_the_scan_sees_an_import_of_inference_in_any_form():
    source = ("import services.inference.server\n"
              "def f():\n    from services.inference import tiny_model\n"
              "from services.weights import sync\n")
    found = {n for n in _imported_modules(ast.parse(source)) if n.startswith("services.inference")}
    assert found == {"services.inference.server", "services.inference", "services.inference.tiny_model"}


def test_the_scan_sees_an_import_of_services_in_any_form_and_not_a_lookalike():
    source = ("import services\n"
              "from services import weights\n"
              "class Settings:\n    def check(self):\n        from services.trainer.group_filters import build_filter\n"
              "import services_extra\nfrom shared.services import x\n")
    assert _forbidden_in(source, "services") == [
        "services", "services.trainer.group_filters", "services.trainer.group_filters.build_filter", "services.weights"]


def test_no_shared_module_imports_services():
    """``shared`` is what the services have in common: an arrow back would make it a service."""
    assert _imports_of("shared", "services") == {}


def test_no_trainer_module_imports_services_inference():
    assert _imports_of("services.trainer", "services.inference") == {}


def test_arrows_run_one_way_trainer_to_weights_to_policy():
    """The trainer publishes into the weights plane (``services.trainer.broadcast_publish``), not
    the other way round; the policy model both use (``services.policy``) imports neither, nor
    inference."""
    assert _imports_of("services.weights", "services.trainer") == {}
    for above in ("services.trainer", "services.weights", "services.inference"):
        assert _imports_of("services.policy", above) == {}, above
