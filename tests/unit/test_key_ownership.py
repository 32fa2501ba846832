"""One owner per Redis key: ``shared.names.REDIS_KEY_OWNERS`` names each key's owner, a module of
``shared.state``, and no other module under ``services/`` or ``shared/`` names the key (found by
the state map's parser, ``services.cli.state_map``, which follows aliases of ``RedisKeys``)."""

from __future__ import annotations

import ast

from services.cli import state_map
from shared.names import REDIS_KEY_OWNERS


def _redis_rows() -> dict[str, tuple[str, ...]]:
    return {e.name.removeprefix("RedisKeys."): e.named_in for e in state_map.entries() if e.kind == "redis"}


def test_every_redis_key_has_one_owner_in_shared_state_that_names_it():
    rows = _redis_rows()
    assert rows.keys() == REDIS_KEY_OWNERS.keys()
    assert all(owner.startswith("shared.state.") for owner in REDIS_KEY_OWNERS.values())
    unnamed = {key: owner for key, owner in REDIS_KEY_OWNERS.items() if owner not in rows[key]}
    assert not unnamed, f"owners that do not name their key (a stale owner in shared/names.py): {unnamed}"


def test_no_module_but_its_owner_names_a_key():
    others = sorted((key, module) for key, named_in in _redis_rows().items() for module in named_in
                    if module != REDIS_KEY_OWNERS[key])
    assert not others, f"modules that name a key they do not own (use the owner's methods): {others}"


def test_a_key_named_through_an_alias_of_redis_keys_is_seen():
    tree = ast.parse("from shared.names import RedisKeys as K\nk, n = RedisKeys, 1\nK.states('r'); k.runs\n")
    assert state_map._redis_keys_aliases(tree) == {"RedisKeys", "K", "k"}
