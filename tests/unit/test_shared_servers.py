"""The test suite's pool of shared servers (tests/shared_servers.py): a server starts once for all
the tests that need it, and stops after the last of them, not at the end of the session."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

from shared_servers import SharedServers


def test_a_pooled_server_starts_once_and_stops_after_its_last_user():
    events: list[str] = []

    @contextmanager
    def server(name):
        events.append(f"start {name}")
        yield name
        events.append(f"stop {name}")

    items = [SimpleNamespace(nodeid=f"t{i}", fixturenames=names) for i, names in
             enumerate([["a"], ["other"], ["a", "b"], ["b"], ["other"]])]
    pool = SharedServers()
    pool.note_users(["a", "b"], items)
    assert pool.last_user == {"a": "t2", "b": "t3"}

    assert pool.get("a", lambda: server("a")) == "a"
    pool.done_with("t0")
    assert pool.get("a", lambda: server("a")) == "a" and pool.get("b", lambda: server("b")) == "b"
    pool.done_with("t2")
    assert events == ["start a", "start b", "stop a"]
    pool.done_with("t4")  # not a last user of anything running
    pool.stop_all()
    assert events == ["start a", "start b", "stop a", "stop b"]
    pool.stop_all()  # nothing left to stop
    assert events[-1] == "stop b" and len(events) == 4
