"""One owner per Redis key: ``shared.names.REDIS_KEY_OWNERS`` names each key's owner module, and
no other module under ``services/`` or ``shared/`` names the key (found by the state map's parser,
``services.cli.state_map``). The few violations left are listed here with why; the list only
shrinks: a listed violation that is gone fails the test too."""

from __future__ import annotations

import ast

from services.cli import state_map
from shared.names import REDIS_KEY_OWNERS

# (key, module that names it although it does not own it) -> why it still does
REMAINING_VIOLATIONS: dict[tuple[str, str], str] = {
    ("checkpoints", "services.inference.control_plane"): "follows the announcements the trainer's loop writes; no owner class yet",
    ("eval_ends", "services.viewer.data"): "reads what the evaluation pass writes; no owner class yet",
}


def _redis_rows() -> dict[str, tuple[str, ...]]:
    return {e.name.removeprefix("RedisKeys."): e.named_in for e in state_map.entries() if e.kind == "redis"}


def test_every_redis_key_has_one_owner_that_names_it():
    rows = _redis_rows()
    assert rows.keys() == REDIS_KEY_OWNERS.keys()
    unnamed = {key: owner for key, owner in REDIS_KEY_OWNERS.items() if owner not in rows[key]}
    assert not unnamed, f"owners that do not name their key (a stale owner in shared/names.py): {unnamed}"


def test_no_module_but_its_owner_names_a_key():
    found = {(key, module) for key, named_in in _redis_rows().items() for module in named_in
             if module != REDIS_KEY_OWNERS[key]}
    new = found - REMAINING_VIOLATIONS.keys()
    assert not new, f"modules that name a key they do not own (use the owner's methods): {sorted(new)}"
    gone = REMAINING_VIOLATIONS.keys() - found
    assert not gone, f"fixed: take these off REMAINING_VIOLATIONS: {sorted(gone)}"


def test_a_key_named_through_an_alias_of_redis_keys_is_seen():
    tree = ast.parse("from shared.names import RedisKeys as K\nk, n = RedisKeys, 1\nK.states('r'); k.runs\n")
    assert state_map._redis_keys_aliases(tree) == {"RedisKeys", "K", "k"}
