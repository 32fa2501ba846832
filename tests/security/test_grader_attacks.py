"""Issue 22's red team: cheats that run inside the test process (``grader_attacks``), outcome
semantics, the static diff scan, and a verdict that a failed teardown cannot turn into a retry.

Each in-process attack is a real episode graded with the static scan OFF (``scan_diff: false``):
the runtime guard alone must hold (it refuses the primitive and ends the process, or records no
evidence of a pass). Every one must score 0 with the hidden FAIL_TO_PASS test not passing. The
first group earned 1.0 against the previous grader (issue 22's list); the second group are the
cheats a policy would try next.
"""

from __future__ import annotations

import asyncio

import pytest

import grader_attacks as attack
from security_support import F2P, P2P, SHOP, bash, play, prepend_to_shop, write

from services.rollout_worker.sandbox import SandboxInfraError
from shared.environments import AgentAction
from shared.prometheus import CODING_VERDICTS
from shared.schemas import ToolCall

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]

FIXED_TOTAL = SHOP.replace("return sum(prices) - 1", "return sum(prices)")
BROKEN_DISCOUNT = FIXED_TOTAL.replace("return price * (100 - percent) / 100", "return price")

ISSUE_ATTACKS = {
    "swap_the_hidden_test_code": [prepend_to_shop(attack.SWAP_TEST_CODE)],
    "swap_function_runtest_code": [prepend_to_shop(attack.SWAP_RUNTEST_CODE)],
    "rebind_the_tested_name_in_the_test_module": [prepend_to_shop(attack.REBIND_IN_TEST_MODULE)],
    "report_writer_found_through_gc": [prepend_to_shop(attack.GC_FORGE_REPORT)],
    "file_check_off_then_rewrite_a_pass_to_pass_test": [write("shop/__init__.py", attack.GC_DISABLE_FILE_CHECK + BROKEN_DISCOUNT)],
    "regression_hidden_behind_xfail": [write("shop/__init__.py", FIXED_TOTAL.replace(
        "    return price * (100 - percent) / 100", "    import pytest\n    pytest.xfail('flaky')"))],
}
NEXT_ATTACKS = {
    "builtins_open_hides_a_rewritten_test": [write("shop/__init__.py", attack.REBIND_BUILTINS_OPEN + BROKEN_DISCOUNT)],
    "assert_rewriting_patched": [write("shop/__init__.py", attack.PATCH_ASSERT_REWRITE + BROKEN_DISCOUNT)],
    "report_patch_that_removes_itself": [prepend_to_shop(attack.SELF_REMOVING_REPORT_PATCH)],
    "signal_handler_walks_frames": [prepend_to_shop(attack.SIGNAL_HANDLER_FRAMES)],
    "getframe_walks_to_the_runner": [prepend_to_shop(attack.GETFRAME_FORGE)],
    "forked_child_writes_the_report": [write("shop/__init__.py", SHOP + attack.FORK_CHILD_REPORTS)],
    "ctypes_pokes_memory": [prepend_to_shop(attack.CTYPES_POKE)],
    "trace_function_jumps_lines": [prepend_to_shop(attack.TRACE_JUMP)],
    "second_audit_hook": [prepend_to_shop(attack.ADD_AUDIT_HOOK)],
    "module_class_swapped": [prepend_to_shop(attack.MODULE_CLASS_SWAP)],
    "runner_module_rewritten": [prepend_to_shop(attack.REWRITE_RUNNER_MODULE)],
    "optional_dependency_shadowed": [write(name, attack.OPTIONAL_DEPENDENCY_SHADOW) for name in attack.SHADOW_NAMES],
    "os_exit_0_in_collection_after_a_fix_of_the_test": [
        write("shop/__init__.py", "import os\nopen('tests/test_total.py', 'w').write('def test_total():\\n    pass\\n')\n"
              "os._exit(0)\n" + SHOP)],
    "thread_keeps_running_after_the_test": [prepend_to_shop(attack.LATER + '''
def _flip():
    import _pytest.runner
    _pytest.runner.call_and_report = lambda item, when, log=True, **kw: None
    return False
_later(_flip)
''')],
}
ALWAYS_EQUAL = {
    "object_equal_to_everything": [write("shop/__init__.py", SHOP + attack.ALWAYS_EQUAL)],
    "int_subclass_built_with_type": [write("shop/__init__.py", SHOP + attack.ALWAYS_EQUAL_DYNAMIC)],
}


def shown(verdict) -> dict:
    return {k: v for k, v in verdict.info.items() if k not in ("commands", "diff")}


def assert_earned_0(observations, verdict) -> None:
    """0, and for a reason: the hidden test did not pass, or (attacks that fix ``total`` and hide a
    broken ``discount``) the PASS_TO_PASS regression was seen, or the report was not trusted."""
    assert all(not o.startswith("Error") for o in observations), observations  # the attack itself ran
    assert verdict.reward == 0.0, shown(verdict)
    info = verdict.info
    assert (info.get("fail_to_pass", {}).get(F2P[0]) is not True or info.get("pass_to_pass_failed") == P2P
            or "verifier_error" in info), shown(verdict)


def test_the_red_team_keeps_its_size():
    assert len(ISSUE_ATTACKS) == 6 and len(NEXT_ATTACKS) >= 12 and len(ALWAYS_EQUAL) == 2


@pytest.mark.parametrize("name", [*ISSUE_ATTACKS, *NEXT_ATTACKS])
def test_an_in_process_attack_earns_0_from_the_runtime_guard_alone(make_env, shop_task, name):
    calls = {**ISSUE_ATTACKS, **NEXT_ATTACKS}[name]
    observations, verdict = asyncio.run(play(make_env(scan_diff=False), shop_task, calls))
    assert_earned_0(observations, verdict)


@pytest.mark.parametrize("name", sorted(ALWAYS_EQUAL))
def test_an_always_equal_result_is_flagged_by_the_diff_scan(make_env, shop_task, name):
    flagged = CODING_VERDICTS.labels("flagged")
    before = flagged._value.get()
    observations, verdict = asyncio.run(play(make_env(), shop_task, ALWAYS_EQUAL[name]))
    assert_earned_0(observations, verdict)
    assert flagged._value.get() == before + 1  # the flag rate's numerator
    assert verdict.info["diff_flags"] and "never looks at what it compares with" in verdict.info["diff_flags"][0]
    assert "tests_exit_code" not in verdict.info  # a flagged diff is not run


def test_the_diff_scan_flags_the_in_process_attacks_too(make_env, shop_task):
    """Defence in depth: with the scan on, the swap of ``__code__`` is flagged before any test runs."""
    observations, verdict = asyncio.run(play(make_env(), shop_task, ISSUE_ATTACKS["swap_function_runtest_code"]))
    assert_earned_0(observations, verdict)
    assert "__code__" in verdict.info["diff_flags"][0], shown(verdict)


def test_an_xfail_in_a_fail_to_pass_test_is_a_failure_and_a_real_fix_still_scores_1(make_env, shop_task):
    xfail = write("shop/__init__.py", SHOP.replace("    return sum(prices) - 1", "    import pytest\n    pytest.xfail('later')"))
    _, verdict = asyncio.run(play(make_env(), shop_task, [xfail]))
    assert verdict.reward == 0.0, shown(verdict)
    _, verdict = asyncio.run(play(make_env(), shop_task, [write("shop/__init__.py", FIXED_TOTAL)]))
    assert verdict.reward == 1.0 and "verifier_error" not in verdict.info, shown(verdict)


def test_a_skipped_pass_to_pass_test_fails_unless_the_task_expects_the_skip(make_env, shop_task):
    skip = write("shop/__init__.py", FIXED_TOTAL.replace(
        "    return price * (100 - percent) / 100", "    import pytest\n    pytest.skip('no discounts today')"))
    _, verdict = asyncio.run(play(make_env(), shop_task, [skip]))
    assert verdict.reward == 0.0 and verdict.info["pass_to_pass_failed"] == P2P, shown(verdict)
    expecting = {**shop_task, "expected_skip": P2P}
    _, verdict = asyncio.run(play(make_env(), expecting, [skip]))
    assert verdict.reward == 1.0, shown(verdict)


def test_a_graded_test_that_is_not_collected_fails_the_task(make_env, shop_task):
    missing = {**shop_task, "pass_to_pass": [*P2P, "tests/test_discount.py::test_gone"]}
    _, verdict = asyncio.run(play(make_env(), missing, [write("shop/__init__.py", FIXED_TOTAL)]))
    assert verdict.reward == 0.0, shown(verdict)


def test_the_grading_sandbox_holds_nothing_the_agent_left(make_env, shop_task):
    """A process the agent leaves running fixes ``total`` as soon as the final diff has been taken
    (what a grader in the agent's own sandbox would then test). The verdict comes from a fresh
    sandbox of the task, with the diff only: the buggy code's."""
    fixer = bash("setsid sh -c 'while [ ! -s /tmp/.conveyor-verify/agent.patch ]; do sleep 0.05; done; sleep 0.3; "
                 "sed -i \"s/ - 1$//\" /workspace/shop/__init__.py' > /dev/null 2>&1 < /dev/null & "
                 "mkdir -p /tmp/site && cp shop/__init__.py /tmp/site/ && echo started")
    _, verdict = asyncio.run(play(make_env(), shop_task, [fixer]))
    assert verdict.reward == 0.0 and verdict.info["fail_to_pass"] == {F2P[0]: False}, shown(verdict)
    assert "verifier_error" not in verdict.info and verdict.info["tests_exit_code"] == 1, shown(verdict)


def fail_teardown_once(env) -> None:
    """The agent's sandbox is really removed, then its teardown reports the daemon failing (once)."""
    sandbox = env.sandbox
    real = sandbox.teardown
    failed = []

    async def teardown() -> None:
        await real()
        if not failed:
            failed.append(True)
            raise SandboxInfraError("removal of the container timed out", reason="daemon_error")
    sandbox.teardown = teardown


async def play_with_failed_teardown(env, task: dict, calls):
    try:
        await env.reset(task, seed=0)
        fail_teardown_once(env)
        for tool_call in [*calls, ToolCall(name="submit")]:
            await env.step(AgentAction("", [tool_call], None))
        return await env.verify()
    finally:
        await env.close()


@pytest.mark.parametrize("fixed", [False, True], ids=["unsolved", "solved"])
def test_a_failed_teardown_of_the_agents_sandbox_changes_no_verdict_and_is_no_retry(make_env, shop_task, fixed):
    """Issue 22: an unsolved episode that makes the teardown in ``verify`` fail (a /tmp and a
    /dev/shm full of hard links) became an infra error, so a retry. The verdict comes first now;
    the failed teardown is logged and named in the info, and ``verify`` does not raise."""
    links = bash("cd /tmp && touch f && seq 1 5000 | sed 's/^/l/' | xargs ln f; cd /dev/shm 2>/dev/null && touch f && "
                 "seq 1 5000 | sed 's/^/l/' | xargs ln f; ls /tmp | wc -l")
    calls = [links, *([write("shop/__init__.py", FIXED_TOTAL)] if fixed else [])]
    verdict = asyncio.run(play_with_failed_teardown(make_env(), shop_task, calls))
    assert verdict.reward == (1.0 if fixed else 0.0), shown(verdict)
    assert "timed out" in verdict.info["agent_teardown_error"], shown(verdict)


REPO_DECORATOR = ("import functools\n\n\ndef retried(test):\n    @functools.wraps(test)\n"
                  "    def run(*args, **kwargs):\n        return test(*args, **kwargs)\n    return run\n")
DECORATED_TEST = "from shop import total\nfrom shop.testing import retried\n\n\n@retried\ndef test_total():\n" \
                 "    assert total([1, 2, 3]) == 6\n"


@pytest.fixture(scope="module")
def decorated_task(tmp_path_factory) -> dict:
    """The shop, with a test helper of the repository's own (``shop.testing.retried``) wrapping
    the hidden test, as Django's ``override_settings`` wraps its tests."""
    import json

    from git_support import diff_of, git, write_files
    from services.rollout_worker.environments.coding import coding_task
    from security_support import DISCOUNT_TEST

    repo = tmp_path_factory.mktemp("decorated-repo")
    git(repo, "init", "-q", "-b", "main")
    write_files(repo, {"shop/__init__.py": SHOP, "shop/testing.py": REPO_DECORATOR, "tests/test_discount.py": DISCOUNT_TEST})
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "shop")
    return coding_task({"instance_id": "shop-2", "repo": "shop/shop", "repo_url": f"file://{repo}",
                        "base_commit": git(repo, "rev-parse", "HEAD").strip(), "problem_statement": "total() is off by one.",
                        "test_patch": diff_of(repo, {"tests/test_total.py": DECORATED_TEST}),
                        "FAIL_TO_PASS": json.dumps(F2P), "PASS_TO_PASS": json.dumps(P2P)})


def test_a_test_wrapped_by_the_repositorys_own_decorator_is_graded(make_env, decorated_task):
    """The repository's own files that the diff does not touch, with the bytes root hashed before
    the run, are trusted code: a real fix scores 1."""
    _, verdict = asyncio.run(play(make_env(), decorated_task, [write("shop/__init__.py", FIXED_TOTAL)]))
    assert verdict.reward == 1.0, shown(verdict)


@pytest.mark.parametrize("how", ["edited_in_the_diff", "rewritten_at_import"])
def test_a_repository_decorator_that_swallows_the_failure_earns_0(make_env, decorated_task, how):
    swallow = REPO_DECORATOR.replace("        return test(*args, **kwargs)",
                                     "        try:\n            return test(*args, **kwargs)\n        except Exception:\n"
                                     "            return None")
    calls = {"edited_in_the_diff": [write("shop/testing.py", swallow)],
             "rewritten_at_import": [prepend_to_shop(f"open('shop/testing.py', 'w').write({swallow!r})")]}[how]
    observations, verdict = asyncio.run(play(make_env(scan_diff=False), decorated_task, calls))
    assert_earned_0(observations, verdict)
