"""The viewer's web app (``conveyor viewer``): runs, groups, trajectories and failures, read-only.

Invariants:
- It reads through ``services.viewer.data`` only, with the services' settings: the same Redis,
  the same object store. It writes nothing.
- A bad request (an unknown run or trajectory, a filter that is not a number) gets a 404 or 400
  page that says what was wrong; one request failing never stops the server.
- Every request is bounded by a page (see ``services.viewer.data``), and its blocking reads
  run in a worker thread, so one slow read never holds up other requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from services.viewer import pages
from services.viewer.data import TrajectoryFilter, ViewerData
from shared.trajectory_lookup import TrajectoryNotFound

log = logging.getLogger(__name__)
DATA = web.AppKey("data", ViewerData)
DECODE: web.AppKey[Callable[[int], str] | None] = web.AppKey("decode")


def _html(text: str, status: int = 200) -> web.Response:
    return web.Response(text=text, content_type="text/html", status=status)


def _float(query: Any, name: str) -> float | None:
    raw = query.get(name, "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise web.HTTPBadRequest(text=pages.page("Bad filter", f"<p>{pages.esc(name)} must be a number, got "
                                                 f"{pages.esc(raw)!s}</p>"), content_type="text/html") from None


def _int(query: Any, name: str, default: int = 0) -> int:
    try:
        return max(0, int(query.get(name, default)))
    except ValueError:
        raise web.HTTPBadRequest(text=pages.page("Bad request", f"<p>{pages.esc(name)} must be a whole number</p>"),
                                 content_type="text/html") from None


def _known_run(data: ViewerData, run_id: str) -> None:
    if not data.has_run(run_id):
        raise web.HTTPNotFound(text=pages.page("Unknown run", f"<p>no run {pages.esc(run_id)} in this Redis</p>"),
                               content_type="text/html")


def runs(request: web.Request) -> web.Response:
    return _html(pages.runs_page(request.app[DATA].runs()))


def run(request: web.Request) -> web.Response:
    data, run_id = request.app[DATA], request.match_info["run"]
    _known_run(data, run_id)
    return _html(pages.run_page(run_id, data.counts(run_id), data.steps(run_id), data.evals(run_id), data.trainer_counters(run_id)))


def groups(request: web.Request) -> web.Response:
    data, run_id = request.app[DATA], request.match_info["run"]
    _known_run(data, run_id)
    page_no = _int(request.query, "page")
    rows = data.groups_page(run_id, page_no)
    has_next = data.registration(run_id, (page_no + 1) * data.page_size) is not None
    return _html(pages.groups_page(run_id, rows, page_no, has_next))


def group(request: web.Request) -> web.Response:
    data, run_id = request.app[DATA], request.match_info["run"]
    group_id = int(request.match_info["group"])
    return _html(pages.group_page(run_id, group_id, data.registration(run_id, group_id), data.group(run_id, group_id)))


def trajectories(request: web.Request) -> web.Response:
    data, run_id, q = request.app[DATA], request.match_info["run"], request.query
    _known_run(data, run_id)
    flt = TrajectoryFilter(min_reward=_float(q, "min_reward"), max_reward=_float(q, "max_reward"),
                           stop_reason=q.get("stop_reason", "").strip(), env_name=q.get("env", "").strip(),
                           kind=q.get("kind", "").strip(), failure_class=q.get("failure_class", "").strip())
    found = data.trajectories_page(run_id, flt, q.get("cursor", "-") or "-")
    query = {k: v for k, v in q.items() if k != "cursor" and v}
    return _html(pages.trajectories_page(run_id, found.rows, query, found.next_cursor, found.scanned))


def failures(request: web.Request) -> web.Response:
    data, run_id, q = request.app[DATA], request.match_info["run"], request.query
    _known_run(data, run_id)
    found = data.failures_page(run_id, q.get("class", "").strip(), _int(q, "cursor"))
    return _html(pages.failures_page(run_id, found.rows, q.get("class", ""), found.next_cursor,
                                     data.rejected_rows(run_id, _int(q, "rejected_page"))))


def trajectory(request: web.Request) -> web.Response:
    try:
        found = request.app[DATA].trajectory(request.match_info["tid"])
    except TrajectoryNotFound as exc:
        return _html(pages.page("Trajectory not found", f"<p>{pages.esc(exc)}</p>"), status=404)
    return _html(pages.trajectory_page(found, request.app[DECODE]))


@web.middleware
async def errors_as_pages(request: web.Request, handler: Callable) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except Exception as exc:  # noqa: BLE001 (one bad request never stops the server)
        log.exception("viewer: %s failed", request.path)
        return _html(pages.page("Error", f"<p>{pages.esc(type(exc).__name__)}: {pages.esc(exc)}</p>"), status=500)


def threaded(page: Callable[[web.Request], web.Response]) -> Callable:
    """Run a page's blocking Redis and S3 reads in a worker thread, off the server's event loop."""
    async def handler(request: web.Request) -> web.Response:
        return await asyncio.to_thread(page, request)

    return handler


def make_app(data: ViewerData, decode: Callable[[int], str] | None = None) -> web.Application:
    app = web.Application(middlewares=[errors_as_pages])
    app[DATA], app[DECODE] = data, decode
    routes = {"/": runs, "/runs/{run}": run, "/runs/{run}/groups": groups, "/runs/{run}/groups/{group:\\d+}": group,
              "/runs/{run}/trajectories": trajectories, "/runs/{run}/failures": failures, "/t/{tid}": trajectory}
    app.add_routes([web.get(path, threaded(page)) for path, page in routes.items()])
    return app


def tokenizer_decode(model_path: str) -> Callable[[int], str] | None:
    """Token id -> text with the policy's tokenizer, or None (ids are shown) where it is absent."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except Exception as exc:  # noqa: BLE001 (the token view works without it)
        log.warning("viewer: no tokenizer at %s (%s): the token view shows ids", model_path, exc)
        return None
    return lambda token_id: tokenizer.decode([token_id])
