"""docs/compose.md promises that every command in it is run by a test: each of its fenced blocks
holds a string that a compose test hands to ``compose_support.doc_commands`` (which then runs
the block's lines as written). A block added without such a test fails here, by its first line.
Read statically: nothing is started."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.M | re.S)  # as compose_support.doc_commands reads them
RUN_BY = re.compile(r'doc_commands\(\s*"([^"]+)"')


def test_every_block_of_the_compose_doc_is_run_by_a_compose_test() -> None:
    keys = {key for path in (ROOT / "tests" / "compose").glob("*.py") for key in RUN_BY.findall(path.read_text())}
    blocks = BLOCK.findall((ROOT / "docs" / "compose.md").read_text())
    assert len(blocks) >= 10 and keys, (len(blocks), keys)
    not_run = [block.strip().splitlines()[0] for block in blocks if not any(key in block for key in keys)]
    assert not_run == [], f"blocks of docs/compose.md that no compose test runs: {not_run}"
