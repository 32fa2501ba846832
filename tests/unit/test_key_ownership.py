"""One owner per Redis key: ``shared.names.REDIS_KEY_OWNERS`` names each key's owner, a module of
``shared.state`` or a package of it (the ledger's modules own its keys together), and no other module under ``services/`` or ``shared/`` names the key (found by
the state map's parser, ``services.cli.state_map``, which follows aliases of ``RedisKeys``).
Nor does any module there but the ledger's own (``shared/state/ledger/``) reach the Redis client through a ledger
(``ledger.redis``): a component is given the client, or the owner it needs, explicitly."""

from __future__ import annotations

import ast
from pathlib import Path

from services.cli import state_map
from shared.names import REDIS_KEY_OWNERS


def _redis_rows() -> dict[str, tuple[str, ...]]:
    return {e.name.removeprefix("RedisKeys."): e.named_in for e in state_map.entries() if e.kind == "redis"}


def _of_owner(module: str, owner: str) -> bool:
    """The owner itself, or a module of the owner's package (``shared.state.ledger.reads``)."""
    return module == owner or module.startswith(owner + ".")


def test_every_redis_key_has_one_owner_in_shared_state_that_names_it():
    rows = _redis_rows()
    assert rows.keys() == REDIS_KEY_OWNERS.keys()
    assert all(owner.startswith("shared.state.") for owner in REDIS_KEY_OWNERS.values())
    unnamed = {key: owner for key, owner in REDIS_KEY_OWNERS.items()
               if not any(_of_owner(module, owner) for module in rows[key])}
    assert not unnamed, f"owners that do not name their key (a stale owner in shared/names.py): {unnamed}"


def test_no_module_but_its_owner_names_a_key():
    others = sorted((key, module) for key, named_in in _redis_rows().items() for module in named_in
                    if not _of_owner(module, REDIS_KEY_OWNERS[key]))
    assert not others, f"modules that name a key they do not own (use the owner's methods): {others}"


def test_a_module_of_the_owners_package_is_the_owner_and_a_namesake_beside_it_is_not():
    assert _of_owner("shared.state.ledger.reads", "shared.state.ledger") and _of_owner("shared.state.run_stop", "shared.state.run_stop")
    assert not _of_owner("shared.state.ledger_retry", "shared.state.ledger")


def test_a_key_named_through_an_alias_of_redis_keys_is_seen():
    tree = ast.parse("from shared.names import RedisKeys as K\nk, n = RedisKeys, 1\nK.states('r'); k.runs\n")
    assert state_map._redis_keys_aliases(tree) == {"RedisKeys", "K", "k"}


ROOT = Path(__file__).resolve().parents[2]
LEDGER_PACKAGE = Path("shared/state/ledger")


def _reaches_through_a_ledger(source: str) -> list[int]:
    """Lines of ``source`` that read ``.redis`` off a ledger: ``ledger.redis``, ``self.ledger.redis``,
    ``self.leases.ledger.redis``, ``_ledger.redis``, ``getattr(ledger, "redis")``."""
    def is_ledger(node: ast.expr) -> bool:
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        return name.lower().endswith("ledger")

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "redis" and is_ledger(node.value):
            lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and is_ledger(node.args[0])
              and isinstance(node.args[1], ast.Constant) and node.args[1].value == "redis"):
            lines.append(node.lineno)
    return sorted(lines)


def test_no_module_but_the_ledger_reaches_redis_through_a_ledger():
    reaches = [f"{path.relative_to(ROOT)}:{line}"
               for folder in ("services", "shared") for path in sorted((ROOT / folder).rglob("*.py"))
               if LEDGER_PACKAGE not in path.relative_to(ROOT).parents
               for line in _reaches_through_a_ledger(path.read_text())]
    assert not reaches, f"reaches through a ledger to its Redis client (pass the client or its owner instead): {reaches}"


def test_a_reach_through_a_ledger_is_seen_and_a_client_of_its_own_is_not():
    reaching = "ledger.redis\nself.ledger.redis.get('k')\nself.leases.ledger.redis\n_ledger.redis\ngetattr(ledger, 'redis')\n"
    assert _reaches_through_a_ledger(reaching) == [1, 2, 3, 4, 5]
    assert _reaches_through_a_ledger("self.redis\nclient.redis\nledger.counts('r')\nredis.Redis\nledger_redis\n") == []
