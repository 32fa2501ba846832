"""Grading by hidden tests: the shell steps and the scoring rule. Pure: commands and parsers only.

The verifier, in a fresh sandbox of the task's image and workspace (never the agent's):

1. checks that ``test_patch`` applies to the base (if not, the task is broken: environment error);
2. applies the agent's diff, minus the protected paths, every path ``test_patch`` touches and
   the files of the graded test ids;
3. applies ``test_patch``;
4. runs FAIL_TO_PASS and PASS_TO_PASS node ids in one test run, output to a file;
5. reads the ``short test summary info`` status lines.

Score = passing FAIL_TO_PASS / all FAIL_TO_PASS, and 0 if any PASS_TO_PASS id does not pass.

Invariants:
- Only the listed ids count: a test the agent adds is never run for reward, and the agent's
  changes to a file that holds a graded test (or that the test patch touches) are not applied.
- An id passes only if the summary after the *last* summary header reports it ``PASSED`` (or
  ``XFAIL``, as SWE-bench counts it) and reports no ``FAILED``/``ERROR`` for it; a missing id
  (not collected, skipped, crashed run, timeout) fails. So output printed by code under test
  cannot turn a failing id into a passing one. (Code under test runs inside the test process and
  could in principle subvert it; the protected paths keep conftest/plugins/config out.)
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

VERIFY_DIR = "/tmp/.conveyor-verify"
AGENT_PATCH = f"{VERIFY_DIR}/agent.patch"
TEST_PATCH = f"{VERIFY_DIR}/test.patch"
TEST_OUTPUT = f"{VERIFY_DIR}/tests.txt"
GIT = "git -c safe.directory='*' -c core.hooksPath=/dev/null -c core.quotepath=off"
_EXCLUDES = ("__pycache__/", "*.pyc", ".pytest_cache/", "*.egg-info/")
SUMMARY_HEADER = re.compile(r"^=+ short test summary info =+$")
_STATUS = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) (.+)$")
PASSING = frozenset({"PASSED", "XFAIL"})


def diff_command(workspace_dir: str, base_sha: str) -> str:
    """In the agent's sandbox: the workspace's changes against the base commit, untracked files
    included, written to AGENT_PATCH. A throwaway index: the agent's own index and HEAD are
    irrelevant (a commit or reset by the agent changes nothing)."""
    index = f"{VERIFY_DIR}/index"
    excludes = f"{VERIFY_DIR}/exclude"
    env = f"GIT_INDEX_FILE={index}"
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
    """What of the agent's diff is not applied: protected patterns, the test patch's files and the
    files of the graded test ids (so an edit cannot weaken a PASS_TO_PASS test)."""
    literal = dict.fromkeys([*patch_paths(test_patch), *test_files(test_ids)])
    return [*protected, *(_wildmatch_literal(p) for p in literal)]


def skipped_by_apply(output: str) -> list[str]:
    """Files ``git apply --verbose`` skipped because of an ``--exclude``."""
    return re.findall(r"^Skipped patch '(.+)'\.$", output, flags=re.MULTILINE)


def apply_test_patch_command(workspace_dir: str) -> str:
    return f"cd {shlex.quote(workspace_dir)} && {GIT} apply --binary --whitespace=nowarn {TEST_PATCH}"


def run_tests_command(workspace_dir: str, test_command: str, ids: list[str]) -> str:
    quoted = " ".join(shlex.quote(i) for i in ids)
    return f"cd {shlex.quote(workspace_dir)} && {test_command} {quoted} > {TEST_OUTPUT} 2>&1"


def summary_lines_command() -> str:
    return (f"grep -E '^(=+ short test summary info =+|(PASSED|FAILED|ERROR|XFAIL|XPASS) .+)$' "
            f"{TEST_OUTPUT} || true")


def output_tail_command(max_bytes: int) -> str:
    return f"tail -c {int(max_bytes)} {TEST_OUTPUT}"


def parse_summary(text: str) -> dict[str, set[str]]:
    """node id -> statuses reported in the last summary section (empty without one)."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if SUMMARY_HEADER.match(line.strip())]
    if not starts:
        return {}
    statuses: dict[str, set[str]] = {}
    for line in lines[starts[-1] + 1 :]:
        match = _STATUS.match(line)
        if not match:
            continue
        status, rest = match.groups()
        node_id = rest.split(" - ", 1)[0] if status in ("FAILED", "ERROR") else rest
        statuses.setdefault(node_id.strip(), set()).add(status)
    return statuses


def passed(statuses: dict[str, set[str]], node_id: str) -> bool:
    seen = statuses.get(node_id, set())
    return bool(seen & PASSING) and not seen & {"FAILED", "ERROR"}


@dataclass(frozen=True)
class Grade:
    reward: float
    fail_to_pass: dict[str, bool] = field(default_factory=dict)
    pass_to_pass: dict[str, bool] = field(default_factory=dict)

    @property
    def regressions(self) -> list[str]:
        return [t for t, ok in self.pass_to_pass.items() if not ok]


def grade(summary: str, fail_to_pass: tuple[str, ...], pass_to_pass: tuple[str, ...]) -> Grade:
    statuses = parse_summary(summary)
    f2p = {t: passed(statuses, t) for t in fail_to_pass}
    p2p = {t: passed(statuses, t) for t in pass_to_pass}
    if not all(p2p.values()):
        return Grade(0.0, f2p, p2p)
    return Grade(sum(f2p.values()) / len(f2p) if f2p else 1.0, f2p, p2p)
