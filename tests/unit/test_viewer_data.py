"""The viewer's reads (services/viewer/data.py) on a real Redis and object store: pages by cursor
with filters, failures with their class and attempts, bounded scans; and its pages escape
what a run holds (model output is untrusted). The pages in a browser: tests/viewer/."""

from __future__ import annotations

import time

from services.intake.datasets import Row
from services.intake.publisher import run_intake
from services.viewer import pages
from services.viewer.data import TrajectoryFilter, ViewerData
from shared.state.ledger import Ledger
from shared.names import RedisKeys, scored_key
from shared.schemas import ScoredEvent, ScoredTrajectory, StopReason
from shared.settings import load_settings
from shared.storage import put_model


def stage(redis_client, store, run_id: str, groups: int = 5, size: int = 4) -> list[str]:
    """``groups`` groups through the ledger: member 3 of each fails (env_error, or an infra error
    for odd groups), the others are scored with reward = episode index / 2."""
    settings = load_settings(run_id=run_id, rollout={"group_size": size})
    rows = [Row(f"mem:{i}", {"id": f"task-{i}", "low": 1, "high": 20, "target": i + 1}) for i in range(groups)]
    published = []
    run_intake(settings, rows, redis_client, published.extend)
    ledger = Ledger(redis_client)
    for request in published:
        tid = request.trajectory_id
        ledger.claim(tid, "tok", 30)
        if request.episode_index == 3:
            kind = "infra_error" if request.group_id % 2 else "env_error"
            ledger.fail(tid, f"{kind}: planted in group {request.group_id}", token="tok")
            continue
        ledger.mark_uploaded(tid, "tok")
        key = scored_key(run_id, request.group_id, tid)
        reward = request.episode_index / 2
        stop = StopReason.done if request.episode_index == 0 else StopReason.max_turns
        put_model(store, key, ScoredTrajectory(trajectory_id=tid, run_id=run_id, group_id=request.group_id,
                                               trajectory_key="t", reward=reward, components=[], stop_reason=stop, scored_at=0.0))
        ledger.mark_scored(tid, ScoredEvent(trajectory_id=tid, run_id=run_id, group_id=request.group_id, reward=reward,
                                            scored_key=key, at=time.time()))
    return [r.trajectory_id for r in published]


def test_trajectory_pages_follow_the_cursor_and_filters_apply_across_pages(redis_client, store, run_id):
    stage(redis_client, store, run_id)
    data = ViewerData(redis_client, store, page_size=4)
    seen, cursor = [], "-"
    while True:
        page = data.trajectories_page(run_id, TrajectoryFilter(), cursor)
        seen += [row.trajectory_id for row in page.rows]
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert len(seen) == len(set(seen)) == 20
    high = data.trajectories_page(run_id, TrajectoryFilter(min_reward=1.0))
    assert [r.reward for r in high.rows] == [1.0] * 4 and high.next_cursor is not None  # 5 of them: a second page
    failed = data.trajectories_page(run_id, TrajectoryFilter(failure_class="infra_error"))
    assert {r.group_id for r in failed.rows} == {1, 3} and all(r.kind == "failed" for r in failed.rows)
    stopped = data.trajectories_page(run_id, TrajectoryFilter(stop_reason="done"))
    assert [r.reward for r in stopped.rows] == [0.0] * 4 and all(r.stop_reason == "done" for r in stopped.rows)
    assert not data.trajectories_page(run_id, TrajectoryFilter(env_name="qa")).rows


def test_a_scan_is_bounded_per_request_and_says_where_to_go_on(redis_client, store, run_id):
    stage(redis_client, store, run_id)
    data = ViewerData(redis_client, store, page_size=4, scan_budget=6)
    page = data.trajectories_page(run_id, TrajectoryFilter(env_name="nowhere"))
    assert page.rows == [] and page.scanned == 6 and page.next_cursor is not None


def test_failures_carry_class_reason_and_attempts_and_filter_by_class(redis_client, store, run_id):
    stage(redis_client, store, run_id)
    data = ViewerData(redis_client, store)
    everything = data.failures_page(run_id)
    assert len(everything.rows) == 5 and everything.next_cursor is None
    assert {f["class"] for f in everything.rows} == {"env_error", "infra_error"} and all(f["attempts"] == 1 for f in everything.rows)
    assert len(data.failures_page(run_id, "env_error").rows) == 3
    redis_client.rpush(RedisKeys.rejected_rows(run_id), '{"source": "d.jsonl:9", "reason": "bad <row>"}')
    assert data.rejected_rows(run_id, 0) == [{"source": "d.jsonl:9", "reason": "bad <row>"}]
    html = pages.failures_page(run_id, everything.rows, "", None, data.rejected_rows(run_id, 0))
    assert "bad &lt;row&gt;" in html and "<row>" not in html


def test_groups_page_by_id_and_model_output_is_escaped(redis_client, store, run_id):
    stage(redis_client, store, run_id)
    data = ViewerData(redis_client, store, page_size=2)
    assert [g for g, _, _ in data.groups_page(run_id, 1)] == [2, 3] and data.groups_page(run_id, 3) == []
    html = pages.token_spans([5, 6], [0, 1], [0.0, -3.2], lambda i: "<script>" if i == 6 else "a")
    assert "&lt;script&gt;" in html and "<script>" not in html and "lp-low" in html


def test_the_app_serves_pages_and_says_what_was_wrong_with_a_bad_request(redis_client, store, run_id):
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from services.viewer.app import make_app

    stage(redis_client, store, run_id)

    async def visit() -> dict[str, tuple[int, str]]:
        async with TestClient(TestServer(make_app(ViewerData(redis_client, store)))) as client:
            pages_seen = {}
            for path in ("/", f"/runs/{run_id}", f"/runs/{run_id}/trajectories?kind=failed", f"/runs/{run_id}/failures",
                         "/runs/nope", f"/runs/{run_id}/trajectories?min_reward=x", f"/t/{run_id}_0_9_9"):
                response = await client.get(path)
                pages_seen[path] = (response.status, await response.text())
            return pages_seen

    seen = asyncio.run(visit())
    assert seen["/"][0] == 200 and run_id in seen["/"][1]
    assert seen[f"/runs/{run_id}"][0] == 200 and "Trajectories by state" in seen[f"/runs/{run_id}"][1]
    failed = seen[f"/runs/{run_id}/trajectories?kind=failed"]
    assert failed[0] == 200 and failed[1].count("pill failed") == 5
    assert seen[f"/runs/{run_id}/failures"][1].count("infra_error") >= 2
    assert seen["/runs/nope"][0] == 404 and "no run nope" in seen["/runs/nope"][1]
    assert seen[f"/runs/{run_id}/trajectories?min_reward=x"][0] == 400
    assert seen[f"/t/{run_id}_0_9_9"][0] == 404 and "no uploaded trajectory" in seen[f"/t/{run_id}_0_9_9"][1]
