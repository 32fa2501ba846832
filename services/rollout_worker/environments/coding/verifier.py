"""Runs the hidden tests in a fresh sandbox and scores them (the steps are in ``grading``).

Invariants:
- The hidden tests (``test_patch``) only ever enter this fresh verification sandbox, after the
  agent's episode is over; the agent's sandbox never holds them.
- What the agent controls reaches the verifier only as its diff, applied without the protected
  paths, the test patch's paths and the graded tests' files and directories.
- Tests run from the grader's own runner as the sandbox user; the reward comes only from the
  signed report in the root-only control directory, checked against the exit status the root
  shell saw (threat model: ``grading``).
- A diff that ``diffscan`` flags scores 0 before any sandbox starts, its reasons in
  ``info["diff_flags"]`` (``config.scan_diff``). ``CODING_VERDICTS`` counts flagged, untrusted
  and graded episodes (the flag rate is flagged / all).
- The verdict is decided before the verification sandbox is torn down, and a teardown that
  fails afterwards is logged and left to the janitor: it never changes the verdict nor turns
  the episode into a retry.
- A broken task (``test_patch`` does not apply to the base) raises ``EnvironmentError_``; anything
  the agent's code does (a diff that does not apply, a crash, a timeout, a killed sandbox) scores 0
  with the reason in the info.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from shared.environments import EnvironmentError_
from shared.prometheus import CODING_VERDICTS
from services.rollout_worker.sandbox import EpisodeTimeout, Sandbox, SandboxLost, files

from . import diffscan, grading
from .config import CodingConfig
from .task import CodingTask
from .tools import clip

log = logging.getLogger(__name__)


async def run_hidden_tests(provision: Callable[[], Awaitable[Sandbox]], diff: bytes, task: CodingTask,
                           config: CodingConfig, on_sandbox: Callable[[Sandbox | None], None]) -> tuple[float, dict[str, Any]]:
    """``provision()`` gives a fresh sandbox holding the base workspace (the agent's starting state)."""
    info: dict[str, Any] = {"verifier": "tests"}
    flags = diffscan.scan(diff.decode(errors="replace")) if config.scan_diff else []
    if flags:
        info.update(diff_flags=flags, verifier_error=f"the diff was flagged by the static scan: {flags[0]}")
        CODING_VERDICTS.labels("flagged").inc()
        return 0.0, info
    sandbox = await provision()
    on_sandbox(sandbox)
    try:
        reward = await _grade_in(sandbox, diff, task, config, info)
    except (SandboxLost, EpisodeTimeout) as exc:
        reward = 0.0
        info["verifier_error"] = f"the verification sandbox stopped ({exc.reason}): {exc}"
    except BaseException:
        await _teardown(sandbox, on_sandbox)
        raise
    CODING_VERDICTS.labels("untrusted" if "report_untrusted" in info else "graded").inc()
    await _teardown(sandbox, on_sandbox)  # the verdict is decided: a failure here is the janitor's
    return reward, info


async def _teardown(sandbox: Sandbox, on_sandbox: Callable[[Sandbox | None], None]) -> None:
    try:
        await sandbox.teardown()
    except Exception as exc:  # the janitor removes it after its TTL
        log.warning("could not tear down the verification sandbox %s: %s", sandbox.name, exc)
    finally:
        on_sandbox(None)


async def _grade_in(sandbox: Sandbox, diff: bytes, task: CodingTask, config: CodingConfig, info: dict[str, Any]) -> float:
    ws = sandbox.spec.workspace_dir
    if task.test_patch.strip():
        await sandbox.write_file(grading.TEST_PATCH, task.test_patch)
        check = await sandbox.exec(grading.check_test_patch_command(ws))
        if check.exit_code != 0:
            raise EnvironmentError_(f"the task's test_patch does not apply to {task.base_commit}: {check.output[-500:]}")
    ids = list(dict.fromkeys([*task.fail_to_pass, *task.pass_to_pass]))
    if diff.strip():
        await sandbox.write_file(grading.AGENT_PATCH, diff)
        excluded = grading.excluded_paths(config.protected_paths, task.test_patch, ids)
        applied = await sandbox.exec(grading.apply_agent_patch_command(ws, excluded))
        info["excluded_from_diff"] = grading.skipped_by_apply(applied.output)
        if applied.exit_code != 0:
            info["verifier_error"] = f"the agent's diff does not apply: {applied.output[-1000:]}"
            return 0.0
    if task.test_patch.strip():
        patched = await sandbox.exec(grading.apply_test_patch_command(ws))
        if patched.exit_code != 0:
            info["verifier_error"] = f"the test patch does not apply over the agent's changes: {patched.output[-1000:]}"
            return 0.0
    intact = await sandbox.exec(grading.test_files_intact_command(ws, ids))
    if intact.exit_code != 0:
        info["verifier_error"] = "a graded test file is missing or reached through a symbolic link"
        return 0.0
    key = secrets.token_hex(32)
    await _install_grader(sandbox, key, grading.patch_paths(diff.decode(errors="replace")))
    run = await sandbox.exec_trusted(grading.run_tests_command(ws, config.test_python, ids),
                                     timeout_s=config.test_timeout_s, max_output_bytes=4096)
    info.update(tests_exit_code=run.exit_code, tests_timed_out=run.timed_out, tests_duration_s=round(run.duration_s, 3))
    report = await sandbox.exec_trusted(grading.read_report_command(), max_output_bytes=16 << 20)
    tail = await sandbox.exec_trusted(grading.output_tail_command(config.info_output_bytes),
                                      max_output_bytes=config.info_output_bytes + 4096)
    info["test_output"] = clip(tail.output, config.info_output_bytes)
    outcomes, distrust = grading.read_report(report.output, key, run.exit_code)
    if distrust:
        info.update(report_untrusted=True, verifier_error=f"the test report is not trusted: {distrust}")
    result = grading.grade(outcomes, task.fail_to_pass, task.pass_to_pass, run.exit_code, task.expected_skip)
    info.update(fail_to_pass=result.fail_to_pass, pass_to_pass_total=len(result.pass_to_pass),
                pass_to_pass_failed=result.regressions)
    if result.missing and not distrust:
        info["not_collected"] = list(result.missing)
    return 0.0 if distrust else result.reward


async def _install_grader(sandbox: Sandbox, key: str, touched: list[str]) -> None:
    """The runner, its ini, the report key and the paths the agent's diff touches, written by
    root into the control directory."""
    commands = [f"umask 022 && mkdir -p {grading.GRADER_DIR} && chmod 755 {grading.GRADER_DIR}"]
    for path, (data, mode) in grading.grader_files(key, touched).items():
        commands += [*files.write_commands(path, data), f"chmod {mode} {path}"]
    for command in commands:
        done = await sandbox.exec_trusted(command)
        if done.exit_code != 0:
            raise EnvironmentError_(f"could not install the grader in the verification sandbox: {done.output[-500:]}")
