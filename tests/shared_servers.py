"""Servers shared by the few modules that need the same one, and stopped after the last of them.

A session fixture keeps its server to the end of the session, through every later module; a
module fixture starts one per module (a vLLM start costs 20 to 45 s). A server in this pool is
keyed by the name of the fixture that hands it out: started the first time a test needs that
fixture, and stopped once the last collected test that needs it has been torn down
(``pytest_runtest_teardown`` in tests/conftest.py), or at the end of the session.

A module that changes such a server gives it back as it was (``pipeline_support.back_as_it_was``),
so the modules sharing it stay independent of their order."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, ExitStack
from typing import Any


class SharedServers:
    def __init__(self) -> None:
        self._running: dict[str, tuple[ExitStack, Any]] = {}
        self.last_user: dict[str, str] = {}  # fixture name -> node id of the last collected test needing it

    def note_users(self, names: Iterable[str], items: Iterable[Any]) -> None:
        """Remember, for each pooled fixture in ``names``, the last of ``items`` that needs it."""
        names = set(names)
        for item in items:
            for name in names.intersection(getattr(item, "fixturenames", ())):
                self.last_user[name] = item.nodeid

    def get(self, name: str, start: Callable[[], AbstractContextManager[Any]]) -> Any:
        """The running server of ``name``; started by entering ``start()`` if none runs."""
        if name not in self._running:
            stack = ExitStack()
            self._running[name] = (stack, stack.enter_context(start()))
        return self._running[name][1]

    def done_with(self, nodeid: str) -> None:
        """Stop the servers whose last user was the test ``nodeid``."""
        for name in [n for n, last in self.last_user.items() if last == nodeid and n in self._running]:
            self.stop(name)

    def stop(self, name: str) -> None:
        stack, _ = self._running.pop(name)
        stack.close()

    def stop_all(self) -> None:
        for name in list(self._running):
            self.stop(name)
