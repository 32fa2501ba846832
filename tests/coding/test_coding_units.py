"""The coding environment's pure parts: row formats, tool-call checking, grading. No Docker."""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest

from services.intake.adapters import RowRejected, adapt_row
from services.rollout_worker.environments.coding import CodingEnv, CodingTask, coding_task, diffscan
from services.rollout_worker.environments.coding import grading
from services.rollout_worker.environments.coding.tools import ToolError, check_call, replace_once
from shared.schemas import ToolCall

SWE = {"instance_id": "o__r-1", "repo": "o/r", "base_commit": "a" * 40, "problem_statement": "fix it",
       "test_patch": "diff --git a/t.py b/t.py\n", "FAIL_TO_PASS": '["t.py::test_a", "t.py::test_a"]',
       "PASS_TO_PASS": '["t.py::test_b", "t.py::test_a"]'}
AGENT = {"repo_name": "o/r", "repo_url": "https://example.invalid/o/r.git", "language": "TypeScript",
         "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "do it"}]}


def test_swe_bench_rows_decode_json_lists_and_dedupe():
    data = coding_task(SWE)
    assert data["format"] == "swe_bench" and data["base_commit"] == "a" * 40 and data["language"] == "python"
    assert data["fail_to_pass"] == ["t.py::test_a"] and data["pass_to_pass"] == ["t.py::test_b"]
    assert coding_task({**SWE, "FAIL_TO_PASS": ["t.py::test_a"], "PASS_TO_PASS": []})["pass_to_pass"] == []
    task = CodingTask.from_data(data)
    assert task.has_tests and task.source_url("https://github.com/{repo}.git") == "https://github.com/o/r.git"
    json.dumps(data)


def test_swe_agent_rows_take_the_human_turn_and_an_optional_label():
    data = coding_task(AGENT)
    assert (data["format"], data["problem_statement"], data["language"]) == ("swe_agent", "do it", "node")
    assert data["label_reward"] is None and data["base_commit"] is None and not CodingTask.from_data(data).has_tests
    assert coding_task({**AGENT, "resolved": True})["label_reward"] == 1.0
    assert coding_task({**AGENT, "reward": 0.25})["label_reward"] == 0.25
    conversations = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    assert coding_task({**AGENT, "conversations": conversations})["problem_statement"] == "hi"


@pytest.mark.parametrize("row, reason", [
    ({**SWE, "FAIL_TO_PASS": "[]"}, "'FAIL_TO_PASS' is empty"),
    ({**SWE, "FAIL_TO_PASS": "not json"}, "not a JSON list"),
    ({**SWE, "PASS_TO_PASS": [1, 2]}, "must be a list of test ids"),
    ({**SWE, "base_commit": "main"}, "'base_commit' must be a 7-40 digit hex"),
    ({**SWE, "problem_statement": " "}, "'problem_statement' must be a non-empty string"),
    ({**SWE, "repo": None}, "'repo' must be a non-empty string"),
    ({**SWE, "test_patch": None}, "'test_patch' must be a string"),
    ({**AGENT, "conversations": [{"from": "system", "value": "s"}]}, "second entry is the human's task"),
    ({**AGENT, "conversations": [{}, {"from": "gpt", "value": "x"}]}, "must come from 'human', got 'gpt'"),
    ({**AGENT, "repo_url": ""}, "'repo_url' must be a non-empty string"),
    ({**AGENT, "score": "high"}, "label field 'score' must be a finite number"),
    ({"prompt": "x"}, "not a coding row"),
])
def test_bad_rows_are_rejected_with_the_field(row, reason):
    with pytest.raises(RowRejected, match=reason.replace("[", r"\[").replace("(", r"\(")):
        coding_task(row)


def test_adapt_row_with_the_coding_validator():
    # the repository checks fetch the repo: tests/coding/test_coding_intake.py runs them on a real one
    task = adapt_row(SWE, "coding", "swe.jsonl:1", {"intake_checks": False})
    assert task.task_id == "o__r-1" and task.env_name == "coding" and task.task_data["repo"] == "o/r"
    with pytest.raises(RowRejected, match="FAIL_TO_PASS"):
        adapt_row({**SWE, "FAIL_TO_PASS": None}, "coding", "", {"intake_checks": False})


def test_env_config_is_validated_with_the_shared_keys_and_unknown_keys_are_refused():
    env = CodingEnv({"max_turns": 30, "command_timeout_s": 5, "images": {"node": "img:1"}})
    assert env.config.command_timeout_s == 5 and env.config.images == {"node": "img:1"} and env.config.max_turns == 30
    with pytest.raises(ValueError, match="command_timeout_s"):
        CodingEnv({"command_timeout_s": -1})
    with pytest.raises(ValueError, match="env_config.comand_timeout_s: Extra inputs are not permitted"):
        CodingEnv({"comand_timeout_s": 5})


def test_tool_calls_are_checked_without_raising():
    assert check_call(ToolCall(name="str_replace", arguments={"path": "a", "old_str": "x", "new_str": ""})) == \
        {"path": "a", "old": "x", "new": ""}
    assert check_call(ToolCall(name="submit")) == {}
    assert isinstance(check_call(ToolCall(name="submit", arguments={"now": True})), ToolError)
    duplicate = check_call(ToolCall(name="str_replace", arguments={"path": "a", "old": "x", "old_str": "y", "new": ""}))
    assert isinstance(duplicate, ToolError) and "given twice" in duplicate.message
    assert replace_once("a b a", "b", "c", "f") == "a c a"
    assert "occurs 2 times" in replace_once("a b a", "a", "c", "f").message


PATCH = """\
diff --git a/tests/test_x.py b/tests/test_x.py
new file mode 100644
--- /dev/null
+++ b/tests/test_x.py
@@ -0,0 +2 @@
+--- a/not/a/header.py
+x
diff --git a/with space.py b/with space.py
--- a/with space.py
+++ b/with space.py
@@ -1 +1 @@
-a
+b
diff --git a/img.png b/img.png
new file mode 100644
GIT binary patch
"""


def test_patch_paths_read_headers_only():
    assert grading.patch_paths(PATCH) == ["tests/test_x.py", "with space.py", "img.png"]
    excluded = grading.excluded_paths(("conftest.py",), "diff --git a/t[1].py b/t[1].py\n", ["a/b.py::T::t[x]"])
    assert excluded == ["conftest.py", r"t\[1\].py", "a/b.py", "a/*"]  # the test's directory too


KEY = "k" * 64


def signed(*records: dict) -> str:
    lines = []
    for seq, record in enumerate(records):
        body = json.dumps({**record, "seq": seq}, sort_keys=True)
        lines.append(body + " " + hmac.new(KEY.encode(), body.encode(), hashlib.sha256).hexdigest())
    return "\n".join(lines) + "\n"


def phase(nodeid: str, outcome: str, when: str = "call", xfail: bool = False) -> dict:
    return {"kind": "phase", "nodeid": nodeid, "when": when, "outcome": outcome, "xfail": xfail}


def ran(nodeid: str, outcome: str = "passed", *, xfail: bool = False, evidence: str = "ran") -> list[dict]:
    """The records of one test: setup, the runner's evidence, call, teardown."""
    return [phase(nodeid, "passed", "setup"), {"kind": evidence, "nodeid": nodeid},
            phase(nodeid, outcome, xfail=xfail), phase(nodeid, "passed", "teardown")]


def finish(status: int, **extra) -> dict:
    return {"kind": "finish", "exitstatus": status, "tampered": [], "plugins_added": [], "problems": [], **extra}


def test_the_signed_report_decides_and_must_agree_with_the_exit_status():
    report = signed(*ran("t.py::a"), phase("t.py::b", "failed"), phase("t.py::c", "skipped", xfail=True),
                    *ran("t.py::d")[:3], phase("t.py::d", "failed", when="teardown"),
                    phase("t.py::e", "passed", "setup"), phase("t.py::e", "passed"), phase("t.py::e", "passed", "teardown"),
                    *ran("t.py::f", evidence="not_genuine"), phase("t.py::g", "skipped", "setup"), finish(1))
    outcomes, why = grading.read_report(report, KEY, 1)
    assert why is None
    # a: passed; b: failed; c: xfail; d: teardown error; e: no evidence that the test's own code
    # returned; f: the function was not the graded one; g: skipped; x: never ran
    assert [grading.passed(outcomes, f"t.py::{t}") for t in "abcdefgx"] == [True] + [False] * 7
    assert grading.passed(outcomes, "t.py::g", expect_skip=True)  # the task expects this skip
    assert grading.grade(outcomes, ("t.py::a", "t.py::b"), (), 1).reward == 0.5
    assert grading.grade(outcomes, ("t.py::a",), ("t.py::c",), 1).reward == 0.0  # an XFAIL PASS_TO_PASS fails
    assert grading.grade(outcomes, ("t.py::a", "t.py::b"), (), 0).reward == 0.0  # exit 0 with a failure: forged
    missing = grading.grade(outcomes, ("t.py::a",), ("t.py::x",), 1)
    assert missing.reward == 0.0 and missing.missing == ("t.py::x",)  # an uncollected test fails the task
    assert grading.grade(outcomes, ("t.py::a", "t.py::g"), (), 0, expected_skip=("t.py::g",)).reward == 1.0

    assert grading.read_report(report, KEY, 0)[1]  # the process exit status differs from pytest's
    assert grading.read_report(report, "other-key", 1)[1]  # not signed by this run's key
    forged = report.replace('"outcome": "failed"', '"outcome": "passed"', 1)
    assert "not signed" in grading.read_report(forged, KEY, 1)[1]
    assert "without finishing" in grading.read_report(signed(phase("t.py::a", "passed")), KEY, 0)[1]
    lines = report.splitlines()
    assert "sequence" in grading.read_report("\n".join([lines[0], *lines[2:]]), KEY, 1)[1]  # a dropped record
    assert "altered" in grading.read_report(signed(*ran("t.py::a"), finish(0, tampered=["x was replaced"])), KEY, 0)[1]
    assert "cannot be trusted" in grading.read_report(signed(*ran("t.py::a"), finish(0, problems=["p"])), KEY, 0)[1]
    refused = {"kind": "refused", "event": "gc.get_objects", "detail": "", "where": "/w/shop.py:3"}
    assert "gc.get_objects" in grading.read_report(signed(*ran("t.py::a"), refused), KEY, 86)[1]
    assert grading.read_report(signed(finish(5)), KEY, 5)[1]  # nothing collected
    assert grading.read_report("PASSED t.py::a\n", KEY, 0)[1]  # printed text is never a report


SCAN_DIFF = """diff --git a/shop/__init__.py b/shop/__init__.py
--- a/shop/__init__.py
+++ b/shop/__init__.py
@@ -1,2 +1,12 @@
 def total(prices):
-    return sum(prices) - 1
+    return Always()
+
+
+class Always:
+    def __eq__(self, other):
+        if other is None:
+            return True
+        return True
+
+    def __ne__(self, other):
+        return other is self
+import sys, gc; sys.modules["shop"] = None; gc.get_referrers(total)
diff --git a/shop/util.py b/shop/util.py
--- /dev/null
+++ b/shop/util.py
@@ -0,0 +1,4 @@
+import builtins
+builtins.sorted = lambda x: x
+f.__code__ = g.__code__
+__eq__ = lambda self, other: True
diff --git a/README.md b/README.md
--- a/README.md
+++ b/README.md
@@ -1 +1 @@
-x
+sys.modules["a"] = 1
"""


def test_the_diff_scan_flags_code_that_only_fools_the_tests():
    reasons = diffscan.scan(SCAN_DIFF)
    assert reasons == ["shop/__init__.py:6: __eq__ returns a constant for everything",
                       "shop/__init__.py:13: walks the object graph (gc)",
                       "shop/__init__.py:13: writes to sys.modules",
                       "shop/util.py:2: writes to builtins", "shop/util.py:3: rewrites a code object (__code__)",
                       "shop/util.py:4: __eq__ never looks at what it compares with"], reasons
    honest = """diff --git a/m.py b/m.py
--- a/m.py
+++ b/m.py
@@ -1 +1,9 @@
+import sys
+class P:
+    def __eq__(self, other):
+        return isinstance(other, P) and self.x == other.x
+    def __hash__(self):
+        return hash(self.x)
+    def __ne__(self, other):
+        return not self == other
+mod = sys.modules[__name__]
"""
    assert diffscan.scan(honest) == []


def test_the_viewer_shows_a_flagged_diff_on_the_trajectory_page():
    from services.viewer.pages import trajectory_page
    from shared.schemas import EpisodeTimings, RolloutRequest, StopReason, TaskProfile, Trajectory
    from shared.trajectory_lookup import FoundTrajectory

    task = TaskProfile(task_id="t-1", env_name="coding", task_data={}, env_config={}, source="rows.jsonl:1")
    request = RolloutRequest(run_id="run", group_id=0, episode_index=0, episode_seed=0, trajectory_id="run_0_0_0",
                             group_size=1, task=task, policy_version=0, dispatched_at=0.0)
    flags = ["shop/__init__.py:6: __eq__ never looks at what it compares with"]
    info = {"diff_flags": flags, "verifier_error": f"the diff was flagged by the static scan: {flags[0]}"}
    flagged = Trajectory(request=request, turns=[], stop_reason=StopReason.done, env_reward=0.0, env_info=info,
                         timings=EpisodeTimings(queue_wait_s=0, episode_s=1, inference_s=0, env_s=0))
    page = trajectory_page(FoundTrajectory("k", flagged, None, None, None), None)
    assert "id='diff-flagged'" in page and "__eq__ never looks at what it compares with" in page
    clean = flagged.model_copy(update={"env_info": {}})
    assert "diff-flagged" not in trajectory_page(FoundTrajectory("k", clean, None, None, None), None)
