"""Grading by hidden tests: the shell steps, the trusted test run and the scoring rule. Pure.

The verifier, in a fresh sandbox of the task's image and workspace (never the agent's: nothing
the agent left there, processes, files in /tmp or /dev/shm, environment, installed packages,
exists where the verdict is made):

0. scans the agent's diff (``diffscan``): a diff that only fools equality or the test machinery
   scores 0 and never runs;
1. checks that ``test_patch`` applies to the base (if not, the task is broken: environment error);
2. applies the agent's diff, minus the protected paths, every path ``test_patch`` touches, the
   files of the graded test ids and everything under their directories;
3. applies ``test_patch``, then checks that every graded test file is a regular file reached
   through no symbolic link;
4. installs the trusted runner (``grader_runner.py``), an empty pytest ini, a fresh HMAC key and
   the paths the diff touches in the root-only ``CONTROL_DIR`` (as root), hashes the graded test
   files and the workspace's ``.py`` files, and runs the
   FAIL_TO_PASS and PASS_TO_PASS ids as the sandbox user, with the report on a descriptor the
   root shell opened;
5. reads the signed report as root and checks it against the exit status the root shell saw.

Outcomes. A graded test passes only if its setup, call and teardown passed and the runner saw
the graded file's own test code return normally (the ``ran`` record, written by the runner's
audit hook, see ``grader_runner``). An XFAIL, an XPASS, a skip or an error is a failure, except a
skip of an id the task lists in ``expected_skip``. Score = passing FAIL_TO_PASS / all
FAIL_TO_PASS, and 0 if any PASS_TO_PASS id fails, if any graded id has no record at all (missing
or never collected), if pytest's exit status disagrees with the per-test records, or if the
report cannot be trusted (``read_report``).

Threat model. The policy controls every byte of its workspace, hence the diff, hence the code
under test, which runs inside the test process. It does not control: the verification sandbox's
image and root filesystem (read-only), the root shell (another uid), ``CONTROL_DIR`` (root-only),
the test patch, or the ids graded. Assumed: CPython's audit hooks fire for the events named in
``grader_runner`` (checked for the image's Python 3.11), the kernel refuses to let another
process of the sandbox user read a non-dumpable process's memory, and the seccomp profile denies
``ptrace`` and ``process_vm_readv``. So:
- Output is never parsed: printing a forged summary, at exit or anywhere, changes nothing.
- The invocation is the grader's: ``python3 -I``, the workspace appended after pytest and the
  standard library, ``-c`` the grader's empty ini, ``--assert=plain`` (no rewriting to patch),
  plugin autoloading off, ``env -i``.
- Files that change how tests are collected or run are never taken from the agent
  (``config.DEFAULT_PROTECTED_PATHS``), nor anything in a graded test's directory, nor the tests.
- Tampering from inside the test process is blocked, not only detected: the runner's PEP 578
  hook refuses tracing, ``gc`` introspection, frames (but for a few standard-library sites that
  never hand one out), ``__code__`` writes, ``ctypes``, ``/proc/*/mem``, a second audit hook and
  signal handlers of code under test, and ends the process with a signed ``refused`` record.
- Evidence of a pass cannot be forged from the test process: the signing key lives only in the
  hook's closure, evidence is accepted only from the runner's own call site in the original
  process's main thread with only trusted code on the stack, and only for the graded file's own
  test code whose module still binds the objects its imports named. pytest's, pluggy's and the
  runner's functions and classes and the builtins are checked at every record.
- A report is trusted only if all signatures check, records are contiguous, nothing was refused
  or replaced, the final record is there and its exit status equals the one the root shell got
  from ``wait``. So ``os._exit``, ``atexit`` tricks, killing the runner, a fork that writes the
  report, a crash or a timeout all score 0.
Remaining risks, stated (docs/security.md has the list): an object whose ``__eq__`` is true for
everything fools any test at run time and is stopped only by the static scan, which a disguised
one can pass; a change that is correct only while the tests run (a monkeypatch of the module
under test that is consistent everywhere) counts as a fix; a thread racing the microseconds
between the runner's check and the test's first global lookup; a repository's test base class
(e.g. Django's ``TestCase``) or untouched decorator calls code the diff changed; pytest's
phase reports (not the ``ran`` evidence) can be bent by code that reaches pytest's objects
through a fixture it is handed, so a setup or teardown error might be hidden that way.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import posixpath
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.rollout_worker.sandbox.protocol import CONTROL_DIR, DROP

VERIFY_DIR = "/tmp/.conveyor-verify"
AGENT_PATCH = f"{VERIFY_DIR}/agent.patch"
TEST_PATCH = f"{VERIFY_DIR}/test.patch"
GRADER_DIR = f"{CONTROL_DIR}/grader"  # root-owned, readable by the sandbox user, not writable
RUNNER = f"{GRADER_DIR}/runner.py"
INI = f"{GRADER_DIR}/pytest.ini"
HASHES = f"{GRADER_DIR}/tests.sha256"  # the graded test files as root found them before the run
REPO_HASHES = f"{GRADER_DIR}/repo.sha256"  # every .py file of the workspace, as root found them before the run
TOUCHED = f"{GRADER_DIR}/touched.txt"  # the paths the agent's diff touches: never trusted code
KEY = f"{CONTROL_DIR}/report.key"  # root-only, like the two below
REPORT = f"{CONTROL_DIR}/report.jsonl"
TEST_OUTPUT = f"{CONTROL_DIR}/tests.txt"
RUNNER_SOURCE = Path(__file__).with_name("grader_runner.py")
GIT = "git -c safe.directory='*' -c core.hooksPath=/dev/null -c core.quotepath=off"
_EXCLUDES = ("__pycache__/", "*.pyc", ".pytest_cache/", "*.egg-info/")
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def diff_command(workspace_dir: str, base_sha: str) -> str:
    """In the agent's sandbox: the workspace's changes against the base commit, untracked files
    included, written to AGENT_PATCH. A throwaway index: the agent's own index and HEAD are
    irrelevant (a commit or reset by the agent changes nothing)."""
    index = f"{VERIFY_DIR}/index"
    excludes = f"{VERIFY_DIR}/exclude"
    env = f"GIT_INDEX_FILE={index} GIT_NO_REPLACE_OBJECTS=1"
    git = f"{GIT} -c core.excludesFile={excludes}"
    return (
        f"mkdir -p {VERIFY_DIR} && rm -f {index} && printf '%s\\n' {' '.join(shlex.quote(e) for e in _EXCLUDES)} "
        f"> {excludes} && cd {shlex.quote(workspace_dir)} && "
        f"{env} {git} read-tree {base_sha} && {env} {git} add --all . && "
        f"{env} {git} diff --cached --binary --no-renames --no-color --no-ext-diff --no-textconv {base_sha} "
        f"> {AGENT_PATCH}"
    )


def patch_paths(patch: str) -> list[str]:
    """Paths a unified git diff touches (both sides of each file header)."""
    paths: list[str] = []
    in_header = False  # between "diff --git" and the first hunk: "---"/"+++" there are file names
    for line in patch.splitlines():
        if line.startswith("diff --git "):
            in_header = True
            rest = line[len("diff --git "):]
            half = (len(rest) - 1) // 2  # "a/P b/P" (unquoted, same path both sides)
            if rest[:2] == "a/" and rest[half : half + 3] == " b/" and rest[2:half] == rest[half + 3 :]:
                paths.append(rest[2:half])
        elif line.startswith("@@"):
            in_header = False
        elif in_header and line.startswith(("--- ", "+++ ")):
            name = _unquote(line[4:].split("\t", 1)[0].strip())
            if name != "/dev/null" and name[:2] in ("a/", "b/"):
                paths.append(name[2:])
    return list(dict.fromkeys(paths))


def _unquote(name: str) -> str:
    """git's C-style quoting of unusual path names ("a/caf\\303\\251.py")."""
    if not (name.startswith('"') and name.endswith('"')):
        return name
    return name[1:-1].encode().decode("unicode_escape").encode("latin-1").decode(errors="replace")


def _wildmatch_literal(path: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", path)


def check_test_patch_command(workspace_dir: str) -> str:
    return f"cd {shlex.quote(workspace_dir)} && {GIT} apply --check {TEST_PATCH}"


def apply_agent_patch_command(workspace_dir: str, excluded: list[str]) -> str:
    excludes = " ".join(shlex.quote(f"--exclude={p}") for p in excluded)
    return (f"cd {shlex.quote(workspace_dir)} && "
            f"{GIT} apply --verbose --binary --whitespace=nowarn {excludes} {AGENT_PATCH}")


def test_files(test_ids: tuple[str, ...] | list[str]) -> list[str]:
    """The files that define the graded tests (the part of a pytest node id before ``::``)."""
    return list(dict.fromkeys(i.split("::", 1)[0] for i in test_ids if "::" in i))


def excluded_paths(protected: tuple[str, ...], test_patch: str, test_ids: list[str]) -> list[str]:
    """What of the agent's diff is not applied: protected patterns, the test patch's files, the
    files of the graded test ids (so an edit cannot weaken a PASS_TO_PASS test) and everything
    in their directories below the root (no ``__init__.py`` or sibling module shadowing the
    imports of a test)."""
    literal = dict.fromkeys([*patch_paths(test_patch), *test_files(test_ids)])
    dirs = dict.fromkeys(posixpath.dirname(p) for p in literal if posixpath.dirname(p))
    return [*protected, *(_wildmatch_literal(p) for p in literal), *(_wildmatch_literal(d) + "/*" for d in dirs)]


def test_files_intact_command(workspace_dir: str, test_ids: list[str]) -> str:
    """Every graded test file is a regular file whose real path is itself (no symlink on the way)."""
    checks = " && ".join(f"[ -f {shlex.quote(f)} ] && [ ! -L {shlex.quote(f)} ] && "
                         f"[ \"$(realpath {shlex.quote(f)})\" = \"$PWD\"/{shlex.quote(f)} ]" for f in test_files(test_ids))
    return f"cd {shlex.quote(workspace_dir)} && {checks or 'true'}"


def skipped_by_apply(output: str) -> list[str]:
    """Files ``git apply --verbose`` skipped because of an ``--exclude``."""
    return re.findall(r"^Skipped patch '(.+)'\.$", output, flags=re.MULTILINE)


def apply_test_patch_command(workspace_dir: str) -> str:
    return f"cd {shlex.quote(workspace_dir)} && {GIT} apply --binary --whitespace=nowarn {TEST_PATCH}"


def run_tests_command(workspace_dir: str, python: str, ids: list[str]) -> str:
    """Root-shell command: hash the graded test files (``HASHES``) and every ``.py`` file of the
    workspace (``REPO_HASHES``; readable), then the runner as the sandbox user (``DROP``), report
    on 3, key on 4."""
    script = f"exec env -i PATH={_PATH} HOME=/tmp LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1 " \
             f"PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 {shlex.quote(python)} -I {RUNNER} \"$@\""
    quoted = " ".join(shlex.quote(i) for i in [workspace_dir, *ids])
    files = " ".join(shlex.quote(f) for f in test_files(ids)) or "/dev/null"
    return (f"cd {shlex.quote(workspace_dir)} && rm -f {REPORT} {TEST_OUTPUT} && umask 022 && "
            f"sha256sum {files} > {HASHES} && "
            f"find . -name '*.py' -type f -not -path './.git/*' -print0 | xargs -0 -r sha256sum > {REPO_HASHES} && "
            f"umask 077 && "
            f"{DROP} {shlex.quote(script)} sh {quoted} 3>{REPORT} 4<{KEY} >{TEST_OUTPUT} 2>&1")


def grader_files(key: str, touched: Sequence[str] = ()) -> dict[str, tuple[bytes, str]]:
    """path -> (content, mode) of what the grader installs in CONTROL_DIR, as root. ``touched``:
    the paths of the agent's diff (the runner never counts their code as the repository's own)."""
    listing = "".join(f"{p}\n" for p in touched if "\n" not in p).encode()
    return {RUNNER: (RUNNER_SOURCE.read_bytes(), "644"), INI: (b"[pytest]\n", "644"), KEY: (key.encode(), "600"),
            TOUCHED: (listing, "644")}


def read_report(text: str, key: str, exit_code: int | None) -> tuple[dict[str, set[str]], str | None]:
    """(node id -> outcome tags, None) from a trustworthy report; ({}, why) otherwise. Tags:
    ``ran`` (the runner saw the graded test's own code return normally), ``<when>:<outcome>`` per
    phase, ``xfail``, ``not_genuine`` (the function or its module's names were not the graded ones)."""
    records = []
    for number, line in enumerate(text.splitlines()):
        body, _, signature = line.rpartition(" ")
        expected = hmac.new(key.encode(), body.encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(signature, expected):
            return {}, f"report line {number} is not signed by the grader"
        record = json.loads(body)
        if record.get("seq") != number:
            return {}, f"report line {number} is out of sequence"
        records.append(record)
    refused = [r for r in records if r["kind"] == "refused"]
    if refused:
        first = refused[0]
        return {}, f"code under test reached for {first['event']} {first['detail']} at {first['where']}".replace("  ", " ")
    if not records or records[-1].get("kind") != "finish":
        return {}, f"the test run ended without finishing its report (exit status {exit_code})"
    finish = records[-1]
    if finish["exitstatus"] != exit_code:
        return {}, f"pytest finished with {finish['exitstatus']} but the process exited with {exit_code}"
    if finish["tampered"] or finish["plugins_added"]:
        return {}, (f"pytest's machinery was altered during the run ({list(finish['tampered'])[:3]}, "
                    f"plugins added: {finish['plugins_added']})")
    if finish["problems"]:
        return {}, f"the run cannot be trusted: {list(finish['problems'])[:5]}"
    outcomes: dict[str, set[str]] = {}
    for record in records:
        if record["kind"] == "phase":
            tags = outcomes.setdefault(record["nodeid"], set())
            tags.add(f"{record['when']}:{record['outcome']}")
            if record["xfail"]:
                tags.add("xfail")
        elif record["kind"] in ("ran", "not_genuine"):
            outcomes.setdefault(record["nodeid"], set()).add(record["kind"])
    if exit_code not in (0, 1):
        return {}, f"pytest exited with {exit_code} (interrupted, internal or usage error, or nothing collected)"
    return outcomes, None


def passed(outcomes: dict[str, set[str]], node_id: str, *, expect_skip: bool = False) -> bool:
    """Every phase passed and the runner saw the test's own code return normally. An XFAIL, an
    XPASS, a skip or an error is a failure, except a skip where the task expects one."""
    seen = outcomes.get(node_id, set())
    if any(tag.endswith(":failed") for tag in seen) or "xfail" in seen or "not_genuine" in seen:
        return False
    if any(tag.endswith(":skipped") for tag in seen):
        return expect_skip
    return {"ran", "setup:passed", "call:passed", "teardown:passed"} <= seen


@dataclass(frozen=True)
class Grade:
    reward: float
    fail_to_pass: dict[str, bool] = field(default_factory=dict)
    pass_to_pass: dict[str, bool] = field(default_factory=dict)
    missing: tuple[str, ...] = ()

    @property
    def regressions(self) -> list[str]:
        return [t for t, ok in self.pass_to_pass.items() if not ok]


def grade(outcomes: dict[str, set[str]], fail_to_pass: tuple[str, ...], pass_to_pass: tuple[str, ...],
          exit_code: int | None = None, expected_skip: tuple[str, ...] = ()) -> Grade:
    """Passing FAIL_TO_PASS / all; 0 if any PASS_TO_PASS fails, if any graded test is missing or
    was never collected (no record at all), or if pytest's exit status disagrees with the records."""
    f2p = {t: passed(outcomes, t, expect_skip=t in expected_skip) for t in fail_to_pass}
    p2p = {t: passed(outcomes, t, expect_skip=t in expected_skip) for t in pass_to_pass}
    missing = tuple(t for t in dict.fromkeys([*fail_to_pass, *pass_to_pass]) if not outcomes.get(t))
    everything = all(f2p.values()) and all(p2p.values())
    if missing or not all(p2p.values()) or (exit_code is not None and (exit_code == 0) != everything):
        return Grade(0.0, f2p, p2p, missing)  # pytest's own verdict must agree with the per-test records
    return Grade(sum(f2p.values()) / len(f2p) if f2p else 1.0, f2p, p2p, missing)


def output_tail_command(max_bytes: int) -> str:
    """Root-shell command: the end of the test run's output (for the info only, never scored)."""
    return f"tail -c {int(max_bytes)} {TEST_OUTPUT} 2>/dev/null"


def read_report_command() -> str:
    return f"cat {REPORT} 2>/dev/null || true"
