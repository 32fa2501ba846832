"""Progress of a command's long work: a bar on a terminal, a line every ``every_s`` elsewhere
(a log file, CI, ``docker logs``), and a last line with the total and the time it took.

Invariant: progress goes to stderr only, so a command's stdout (``--json``) stays parseable.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True)


@contextmanager
def progress(description: str, total: int | None = None, every_s: float = 10.0) -> Iterator[Callable[[int], None]]:
    """Yields ``advance(n=1)``."""
    started, done = time.monotonic(), 0
    if console.is_terminal:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TimeRemainingColumn(), console=console, transient=True) as bar:
            task = bar.add_task(description, total=total)

            def advance(n: int = 1) -> None:
                nonlocal done
                done += n
                bar.advance(task, n)

            yield advance
    else:
        last = started

        def advance(n: int = 1) -> None:
            nonlocal done, last
            done += n
            if time.monotonic() - last >= every_s:
                last = time.monotonic()
                of = f" of {total}" if total else ""
                print(f"{description}: {done}{of} ({time.monotonic() - started:.0f}s)", file=sys.stderr, flush=True)


        yield advance
    print(f"{description}: {done} done in {time.monotonic() - started:.1f}s", file=sys.stderr, flush=True)
