"""Where blocking docker SDK calls run: a dedicated thread pool, never the event loop.

Invariant: no coroutine in this package calls the docker SDK directly; it awaits ``run_blocking``.
The pool is separate from asyncio's default executor (6 threads on a 2-core host), so slow daemon
calls cannot starve other ``to_thread`` users, and it is process-wide, so it works from any loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
from typing import Callable, TypeVar

T = TypeVar("T")

EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="conveyor-docker")


def submit(fn: Callable[..., T], *args, **kwargs) -> concurrent.futures.Future[T]:
    """Start ``fn`` on the docker pool without waiting; the call finishes even if nobody awaits it."""
    ctx = contextvars.copy_context()
    return EXECUTOR.submit(ctx.run, functools.partial(fn, *args, **kwargs))


async def run_blocking(fn: Callable[..., T], *args, **kwargs) -> T:
    """Await ``fn(*args, **kwargs)`` run on the docker pool.

    Cancelling the awaiting task does not interrupt the call (threads cannot be interrupted);
    callers that create resources must clean up after it (see ``deployment.start_container``).
    """
    return await asyncio.wrap_future(submit(fn, *args, **kwargs))
