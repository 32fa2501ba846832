"""Conveyor's admin routes on vLLM's API server, loaded with ``--middleware`` (a plain ASGI
middleware: every other request passes straight through to vLLM's app).

``POST /conveyor/pause`` pauses the scheduler as vLLM's ``POST /pause?mode=keep`` does (requests
in flight are frozen, not aborted; new ones queue) without the 20 ms sleep vLLM 0.32's
``AsyncLLM.pause_generation`` adds after the pause for the ordering of outputs its own callers
see (its comment: "not required for correctness"). A weight sync pauses once a version, so on
a small model the sleep was a third of the pause-to-resume time of a broadcast sync
(``docs/performance/loop_speed.md``).

Invariants:
- The pause is the engine's own (``engine_core.pause_scheduler_async(mode="keep",
  clear_cache=True)``, what vLLM's route calls, caches cleared and running requests preempted
  alike): when the call answers 200, the scheduler is paused exactly as after vLLM's route, and
  ``/resume``, ``/is_paused`` and every weight-sync call work on it unchanged.
- Only the paths in ``ROUTES`` are answered here; any other request, and any request that is
  not HTTP, reaches vLLM untouched.
- A failure answers 500 with the error's text; nothing here raises into the server. A vLLM
  without the engine call a route needs (another version, in the compose stack's GPU image)
  answers 404, as a server without the middleware does, and the caller uses vLLM's route.

Only the standard library is imported at module level: the module runs inside vLLM's API
server process (and the compose stack's GPU image), next to the worker extension.
"""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger(__name__)

PAUSE_PATH = "/conveyor/pause"


class NotOffered(Exception):
    """This vLLM lacks what the route needs: answered 404, so the caller takes vLLM's own route."""


async def _pause(engine: Any) -> dict[str, Any]:
    pause_scheduler = getattr(getattr(engine, "engine_core", None), "pause_scheduler_async", None)
    if pause_scheduler is None:
        raise NotOffered(f"{type(engine).__name__} has no engine_core.pause_scheduler_async: use /pause")
    renderer = getattr(engine, "renderer", None)
    if renderer is not None and hasattr(renderer, "clear_mm_cache_async"):
        await renderer.clear_mm_cache_async()  # as vLLM's pause does: multimodal inputs are re-rendered after
    await pause_scheduler(mode="keep", clear_cache=True)  # what vLLM's route passes
    return {"status": "paused"}


ROUTES = {("POST", PAUSE_PATH): _pause}


class ConveyorAdminRoutes:
    """ASGI middleware: answers ``ROUTES`` with the app's engine client, passes the rest on."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        handler = ROUTES.get((scope.get("method", ""), scope.get("path", ""))) if scope["type"] == "http" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        try:
            status, body = 200, await handler(scope["app"].state.engine_client)
        except NotOffered as exc:
            status, body = 404, {"error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - answered, never raised into the server
            log.exception("%s failed", scope["path"])
            status, body = 500, {"error": f"{type(exc).__name__}: {exc}"}
        payload = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})
