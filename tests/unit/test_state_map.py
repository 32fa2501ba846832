"""``docs/architecture.md``'s map of queues, Redis keys and object prefixes matches the code
(``services.cli.state_map``), and the map sees what it claims to see."""

from __future__ import annotations

import subprocess
import sys

from services.cli import state_map
from shared.names import RedisKeys


def test_the_page_holds_the_map_the_code_makes():
    done = subprocess.run([sys.executable, "-m", "services.cli.state_map", "--check"], cwd=state_map.ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_every_declared_key_is_a_row_with_what_it_holds_and_who_names_it():
    rows = {e.name: e for e in state_map.entries()}
    declared = {f"RedisKeys.{name}" for name, value in vars(RedisKeys).items()
                if not name.startswith("_") and (isinstance(value, (str, staticmethod)))}
    assert declared and declared <= rows.keys()
    states = rows["RedisKeys.states"]
    assert states.shape == "conveyor:{run_id}:state" and "state" in states.holds
    assert "shared.state.ledger.transitions" in states.named_in and "shared.names" not in states.named_in
    assert rows["RedisKeys.run_stop"].named_in == ("shared.state.run_stop",)
    assert rows["ROLLOUT_QUEUE"].shape == "rollouts" and rows["batch_key"].shape == "batches/{run_id}/{group_id:06d}.json.gz"


def test_a_stale_page_is_refused(tmp_path, monkeypatch):
    page = tmp_path / "architecture.md"
    page.write_text(state_map.DOC.read_text().replace("| redis | `RedisKeys.runs`", "| redis | `RedisKeys.gone`"))
    monkeypatch.setattr(state_map, "DOC", page)
    monkeypatch.setattr(sys, "argv", ["state_map", "--check"])
    try:
        state_map.main()
    except SystemExit as stop:
        assert "the state map is stale" in str(stop.code)
    else:
        raise AssertionError("a stale page passed the check")
