"""Every Lua script of ``shared.state`` names its KEYS and ARGV once, at the top: one ``local``
line per array, before the script does anything, and no fixed ``KEYS[n]`` or ``ARGV[n]`` after
it (an index computed in a loop, ``ARGV[i]``, is what is left)."""

from __future__ import annotations

import importlib
import pkgutil
import re

import shared.state

FIXED = re.compile(r"\b(KEYS|ARGV)\[\d+\]")
HEADER = re.compile(r"^local [\w, ]+ = (?:(KEYS|ARGV)\[\d+\](?:, )?)+$")


def _scripts() -> dict[str, str]:
    found = {}
    for module in pkgutil.iter_modules(shared.state.__path__):
        loaded = importlib.import_module(f"shared.state.{module.name}")
        found |= {f"{module.name}.{name}": value for name, value in vars(loaded).items()
                  if isinstance(value, str) and "redis.call" in value and "KEYS" in value}
    return found


def test_each_lua_script_names_its_keys_and_argv_once_at_the_top():
    scripts = _scripts()
    assert {"ledger_lua.TRANSITION", "staleness._TRY_ADMIT", "train_queue._COMMIT_SELECTION"} <= scripts.keys()
    for name, script in scripts.items():
        lines = [line.strip() for line in script.splitlines() if line.strip() and not line.strip().startswith("--")]
        headers = [i for i, line in enumerate(lines) if HEADER.match(line)]
        arrays = [HEADER.match(lines[i]).group(1) for i in headers]  # type: ignore[union-attr]
        assert arrays and arrays[0] == "KEYS" and len(set(arrays)) == len(arrays), f"{name}: {arrays}"
        first_call = next(i for i, line in enumerate(lines) if "redis.call" in line and not line.startswith("local function")
                          and not _in_function(lines, i))
        assert all(i < first_call for i in headers), f"{name}: a KEYS/ARGV line after the script began"
        stray = [line for i, line in enumerate(lines) if i not in headers and FIXED.search(line)]
        assert not stray, f"{name} indexes KEYS/ARGV past its header: {stray}"


def _in_function(lines: list[str], index: int) -> bool:
    """Whether line ``index`` is inside a ``local function ... end`` block (a helper prepended)."""
    depth = 0
    for line in lines[:index]:
        if line.startswith("local function"):
            depth += 1
        elif line == "end" and depth:
            depth -= 1
    return depth > 0
