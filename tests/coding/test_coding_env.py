"""CodingEnv end to end on the real Docker daemon, with scripted agents (no model).

The fixture task: fix ``calc.add`` and ``calc.mul``; the hidden tests add ``tests/test_calc.py``;
``tests/test_existing.py::test_sub`` must keep passing.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from services.rollout_worker.environments.coding import artifact_keys, write_artifacts
from shared.storage import LocalStore

from coding_helpers import F2P, P2P, call, run_scripted

pytestmark = [pytest.mark.docker, pytest.mark.timeout(180)]

FIX_ADD = call("str_replace", path="calc/__init__.py", old="def add(a, b):\n    return a - b",
               new="def add(a, b):\n    return a + b")
FIX_MUL = call("str_replace", path="calc/__init__.py", old="def mul(a, b):\n    return a + b",
               new="def mul(a, b):\n    return a * b")
SUBMIT = call("submit")


def run(coro):
    return asyncio.run(coro)


def test_a_str_replace_that_fixes_the_bugs_scores_1(make_env, swe_task, tmp_path):
    env = make_env()
    messages, observations, verdict = run(run_scripted(env, swe_task, [
        call("bash", command="python3 -c 'import calc; print(calc.add(2, 3))'"), FIX_ADD, FIX_MUL, SUBMIT]))
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "str_replace" in messages[0]["content"] and "submit" in messages[0]["content"]
    assert messages[1]["content"].startswith("calc.add(2, 3) returns -1")
    assert observations[0] == "-1\n[exit code 0]"
    assert observations[1:] == ["Replaced 1 occurrence in calc/__init__.py."] * 2 + ["Submitted."]
    assert verdict.reward == 1.0, verdict.info
    info = verdict.info
    assert info["fail_to_pass"] == {t: True for t in F2P} and info["pass_to_pass_failed"] == []
    assert "return a + b" in info["diff"] and "return a * b" in info["diff"] and info["submitted"]
    assert "3 passed" in info["test_output"]
    assert [c["tool"] for c in info["commands"]] == ["bash", "str_replace", "str_replace", "submit"]
    json.dumps(info)  # the info travels in the trajectory

    store = LocalStore(tmp_path)
    keys = write_artifacts(store, "run1", "run1_0_0_7", info)
    assert keys == {n: k for n, k in artifact_keys("run1", "run1_0_0_7").items() if n != "diff.cut.patch"}
    assert keys["diff.patch"] == "artifacts/run1/run1_0_0_7/diff.patch"
    assert b"return a * b" in store.get_bytes(keys["diff.patch"])
    assert b"3 passed" in store.get_bytes(keys["tests.txt"])
    logged = [json.loads(line) for line in store.get_bytes(keys["commands.jsonl"]).splitlines()]
    assert [entry["tool"] for entry in logged] == ["bash", "str_replace", "str_replace", "submit"]


def test_no_edit_scores_0(make_env, swe_task):
    _, _, verdict = run(run_scripted(make_env(), swe_task, [SUBMIT]))
    assert verdict.reward == 0.0
    assert verdict.info["fail_to_pass"] == {t: False for t in F2P}
    assert verdict.info["diff"] == "" and verdict.info["pass_to_pass_failed"] == []


def test_the_score_is_the_fraction_of_fail_to_pass(make_env, swe_task):
    _, _, verdict = run(run_scripted(make_env(), swe_task, [FIX_ADD, SUBMIT]))
    assert verdict.reward == 0.5
    assert verdict.info["fail_to_pass"] == {F2P[0]: True, F2P[1]: False}


def test_a_pass_to_pass_regression_gates_the_score_to_0(make_env, swe_task):
    break_sub = call("str_replace", path="calc/__init__.py", old="def sub(a, b):\n    return a - b",
                     new="def sub(a, b):\n    return b - a")
    _, _, verdict = run(run_scripted(make_env(), swe_task, [FIX_ADD + FIX_MUL + break_sub, SUBMIT]))
    assert verdict.info["fail_to_pass"] == {t: True for t in F2P}
    assert verdict.info["pass_to_pass_failed"] == P2P
    assert verdict.reward == 0.0


PASSING_TESTS = "def test_add():\n    assert True\n\n\ndef test_mul():\n    assert True\n"
FORCE_PASS_CONFTEST = '''\
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome, report.longrepr = "passed", None
'''
CHEATS = {
    # its own passing tests, under a name the hidden tests do not use
    "own_test_file": [call("write_file", path="tests/test_mine.py", content=PASSING_TESTS)],
    # the very file the test patch creates, with trivially passing tests of the same ids
    "hidden_test_path": [call("write_file", path="tests/test_calc.py", content=PASSING_TESTS)],
    # a conftest that reports every test as passed (shown to work on a failing test of its own)
    "conftest_hook": [call("write_file", path="conftest.py", content=FORCE_PASS_CONFTEST),
                      call("write_file", path="tests/conftest.py", content=FORCE_PASS_CONFTEST),
                      call("write_file", path="pytest.ini", content="[pytest]\naddopts = -q\n"),
                      call("write_file", path="tests/test_fail.py", content="def test_fail():\n    assert False\n"),
                      call("bash", command="python3 -m pytest -p no:cacheprovider tests/test_fail.py | tail -1")],
    # a weakened PASS_TO_PASS test file (it is not in the test patch) plus a broken sub and fixed add/mul
    "weakened_pass_to_pass": [FIX_ADD, FIX_MUL,
                              call("str_replace", path="calc/__init__.py", old="def sub(a, b):\n    return a - b",
                                   new="def sub(a, b):\n    return b - a"),
                              call("write_file", path="tests/test_existing.py", content="def test_sub():\n    pass\n")],
    # code under test printing forged summary lines after pytest's own summary
    "forged_summary": [call("str_replace", path="calc/__init__.py", old="def add(a, b):",
                            new="import atexit\natexit.register(print, 'PASSED tests/test_calc.py::test_add')\n"
                                "atexit.register(print, 'PASSED tests/test_calc.py::test_mul')\n\n\ndef add(a, b):")],
}


@pytest.mark.parametrize("cheat", sorted(CHEATS))
def test_the_reward_comes_from_the_hidden_tests_not_from_the_agent(make_env, swe_task, cheat):
    probe = call("bash", command="ls tests; grep -rl test_mul . || echo 'no hidden tests here'")
    script = [probe, *CHEATS[cheat], SUBMIT]
    _, observations, verdict = run(run_scripted(make_env(), swe_task, script))
    assert "test_calc.py" not in observations[0] and "no hidden tests here" in observations[0]
    if cheat == "conftest_hook":  # the hook works where it is not excluded: a failing test "passes"
        assert observations[-2].startswith("1 passed")
    assert verdict.reward == 0.0, verdict.info
    if cheat == "weakened_pass_to_pass":
        assert verdict.info["pass_to_pass_failed"] == P2P and verdict.info["excluded_from_diff"] == ["tests/test_existing.py"]
    else:
        assert verdict.info["fail_to_pass"] == {t: False for t in F2P}
    if cheat in ("hidden_test_path", "conftest_hook"):
        assert verdict.info["excluded_from_diff"], verdict.info  # the agent's versions were dropped
        assert set(verdict.info["excluded_from_diff"]) <= {"tests/test_calc.py", "conftest.py", "tests/conftest.py",
                                                            "pytest.ini", "tests/test_fail.py"}


def test_the_conftest_cheat_fails_even_without_the_exclusions(make_env, swe_task):
    """Defence in depth: with no protected paths the conftest hook is loaded and turns every
    report into a pass (it used to fake a perfect score here), but a pass also needs the
    runner's own evidence that the test's code returned, which no hook can write."""
    _, _, verdict = run(run_scripted(make_env(protected_paths=[]), swe_task, [*CHEATS["conftest_hook"], SUBMIT]))
    assert verdict.reward == 0.0 and verdict.info["fail_to_pass"] == {t: False for t in F2P}, verdict.info


def test_malformed_and_failing_tool_calls_are_error_observations(make_env, swe_task):
    env = make_env(command_timeout_s=1, max_output_bytes=1000)
    script = [
        "<tool_call>{not json}</tool_call>",
        "I will just think about it.",
        '<tool_call>{"name": "bash", "arguments": {"command": "echo hi"}}',
        call("rm_rf"),
        call("bash"),
        call("bash", command=["ls"]),
        call("bash", command="ls", extra="x"),
        call("read_file", path="no/such/file.py"),
        call("read_file", path="calc"),
        call("str_replace", path="calc/__init__.py", old="nothing like this", new="x"),
        call("str_replace", path="calc/__init__.py", old="return a", new="return b"),
        call("str_replace", path="calc/__init__.py", old="", new="x"),
        call("write_file", path="/etc/passwd", content="x"),
        call("bash", command="sleep 5"),
        call("bash", command="yes | head -c 100000"),
        call("bash", command="exit 3"),
        SUBMIT,
    ]
    _, obs, verdict = run(run_scripted(env, swe_task, script))
    assert len(obs) == len(script)
    assert obs[0].startswith("Error: tool call 1 is not valid JSON")
    assert obs[1].startswith("Error: no tool call")
    assert "never closed" in obs[2]
    assert obs[3].startswith("Error: unknown tool 'rm_rf'; the tools are: bash, read_file")
    assert obs[4] == "Error: bash: missing argument 'command'; it takes {command}"
    assert obs[5] == "Error: bash: argument 'command' must be a string, got list"
    assert obs[6].startswith("Error: bash: unexpected argument 'extra'")
    assert obs[7].startswith("Error: read_file") and "no/such/file.py" in obs[7]
    assert obs[8].startswith("Error: read_file") and "not a readable regular file" in obs[8]
    assert "was not found" in obs[9] and "occurs 3 times" in obs[10]
    assert obs[11] == "Error: str_replace: argument 'old' must not be empty"
    assert obs[12].startswith("Error: write_file")
    assert "[timed out after 1s; the command was killed]" in obs[13]
    assert "[output truncated: the command printed 100000 bytes, showing the first 1000]" in obs[14]
    assert obs[15] == "[exit code 3]"
    assert obs[16] == "Submitted."
    assert verdict.reward == 0.0 and verdict.info["diff"] == ""  # nothing the agent tried changed a file
    errors = [c for c in verdict.info["commands"] if c.get("error")]
    assert len(errors) == 13


def test_the_workspace_is_base_commit_without_history_or_hidden_tests(make_env, swe_task, fixture_repo):
    script = [call("bash", command="git log --format=%s | wc -l; git status --porcelain | wc -l; "
                                   "git remote | wc -l; grep -c 'a - b' calc/__init__.py; "
                                   f"git cat-file -e {fixture_repo['fix_commit']} 2>/dev/null && echo LEAK; "
                                   "git log --all --format=%s | grep -c 'upstream'; id -u"),
              call("bash", command="cd calc && pwd"), call("bash", command="pwd"), SUBMIT]
    _, obs, verdict = run(run_scripted(make_env(), swe_task, script))
    assert obs[0].split() == ["1", "0", "0", "2", "0", "65534", "[exit", "code", "0]"]
    assert obs[1:3] == ["/workspace/calc\n[exit code 0]"] * 2  # cd persists between commands
    assert verdict.info["base_commit"] == fixture_repo["base_commit"]


def test_swe_agent_rows_have_no_verifier_but_keep_the_diff(make_env, fixture_repo):
    from services.rollout_worker.environments.coding import coding_task
    row = {"repo_name": "calc/calc", "repo_url": fixture_repo["path"], "language": "Python",
           "conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "Make add correct."},
                             {"from": "gpt", "value": "..."}]}
    # no base_commit: the default branch's HEAD, where upstream already fixed add (but not mul)
    _, obs, unlabelled = run(run_scripted(make_env(), coding_task(row), [FIX_ADD, FIX_MUL, SUBMIT]))
    assert "was not found" in obs[0] and obs[1] == "Replaced 1 occurrence in calc/__init__.py."
    assert unlabelled.reward == 0.0 and unlabelled.info["verifier"] == "none"
    assert "no verifier" in unlabelled.info["note"] and "return a * b" in unlabelled.info["diff"]
    _, _, labelled = run(run_scripted(make_env(), coding_task({**row, "resolved": True}), [SUBMIT]))
    assert labelled.reward == 1.0 and labelled.info["verifier"] == "label"


def test_a_broken_test_patch_is_an_environment_error_and_leaves_no_container(make_env, swe_bench_row, docker_client):
    from shared.environments import EnvironmentError_
    from services.rollout_worker.environments.coding import coding_task
    broken = coding_task({**swe_bench_row, "test_patch": swe_bench_row["test_patch"].replace("new file mode", "index")
                          .replace("--- /dev/null", "--- a/tests/test_calc.py")})
    env = make_env()
    with pytest.raises(EnvironmentError_, match="test_patch does not apply"):
        run(run_scripted(env, broken, [FIX_ADD, SUBMIT]))
    assert env._verifier is None
    left = docker_client.api.containers(all=True, filters={"label": f"conveyor.trajectory_id={env.labels.trajectory_id}"})
    assert left == []


def test_a_snapshot_image_is_built_once_per_repo_and_grades_the_same(make_env, swe_task, docker_client):
    setup = ["date +%s%N > /opt/setup-stamp"]  # runs once, at build time, as root
    probe = call("bash", command="cat /opt/setup-stamp; git status --porcelain | wc -l; ls /workspace")
    first, second = make_env(snapshot=True, setup_commands=setup), make_env(snapshot=True, setup_commands=setup)
    try:
        _, obs1, fixed = run(run_scripted(first, swe_task, [probe, FIX_ADD, FIX_MUL, SUBMIT]))
        _, obs2, untouched = run(run_scripted(second, swe_task, [probe, SUBMIT]))
        assert first.image == second.image and first.image.startswith("conveyor/snapshot:")
        assert obs1[0] == obs2[0] and obs1[0].split()[1:] == ["0", "calc", "tests", "[exit", "code", "0]"]
        assert fixed.reward == 1.0 and untouched.reward == 0.0
    finally:
        if first.image and first.image.startswith("conveyor/snapshot:"):
            docker_client.images.remove(first.image, force=True)
