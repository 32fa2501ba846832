"""The coding environment's settings, read from ``env_config``.

``CodingConfig`` extends ``shared.environments.EnvConfig`` (the runner's keys: ``max_turns``,
``episode_timeout_s``, ...). Unknown keys are refused, and a bad value is an error naming the
field, at intake and at ``CodingEnv(...)``.

Invariant: every default is safe for an untrusted agent: the sandbox defaults of
``SandboxSpec`` (no network, non-root, bounded pids/memory/CPU, read-only root), bounded command
time and output, and the test-infrastructure files in ``protected_paths`` are never taken from the
agent's diff at verification.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from shared.environments import EnvConfig

# git-apply wildmatch patterns (``*`` also matches ``/``): files the agent may edit in its sandbox
# but whose changes are dropped before the hidden tests run, because they could change how the
# tests are collected or reported rather than what they test.
# The grader also runs pytest from its own invocation and ini (``grading``), so most of these are
# belt and braces; conftest.py files are the ones pytest still loads from the workspace.
DEFAULT_PROTECTED_PATHS = (
    "conftest.py", "*/conftest.py", "pytest.ini", "*/pytest.ini", ".pytest.ini", "*/.pytest.ini",
    "tox.ini", "*/tox.ini", "setup.cfg", "*/setup.cfg", "pyproject.toml", "*/pyproject.toml",
    "sitecustomize.py", "*/sitecustomize.py", "usercustomize.py", "*/usercustomize.py", "*.pth",
    "pytest.py", "_pytest/*", "pluggy/*", "*.pyc", "__pycache__/*", "*/__pycache__/*", ".pytest_cache/*",
    ".git/*", ".gitattributes", "*/.gitattributes",
)


class CodingConfig(EnvConfig):
    image: str | None = None  # one image for every task (overrides images/task image)
    images: dict[str, str] = Field(default_factory=dict)  # language -> image tag
    build_missing_images: bool = True  # build a known language's base image (debootstrap) if absent
    repo_url_template: str = "https://github.com/{repo}.git"
    intake_checks: bool = True  # intake fetches the repo and rejects rows whose test_patch does not apply
    workspace_cache_dir: str | None = None  # host cache of prepared workspaces; default: $TMPDIR
    # per-repo snapshot image (workspace + setup baked in, built once per tag): see ``snapshot``
    snapshot: bool = False
    setup_commands: tuple[str, ...] = ()  # run at snapshot build time, as root, in /workspace
    snapshot_network: str = "none"  # docker build network for the setup commands ("bridge" to download)
    # agent tools
    command_timeout_s: float = Field(60.0, gt=0)
    max_output_bytes: int = Field(16 << 10, gt=0)  # per tool observation
    max_read_bytes: int = Field(1 << 20, gt=0)  # read_file / str_replace refuse larger files
    # sandbox
    user: str | None = "65534:65534"
    limits: dict[str, Any] = Field(default_factory=dict)  # SandboxSpec.limits fields
    provision_timeout_s: float = Field(120.0, gt=0)
    episode_timeout_s: float = Field(1800.0, gt=0)  # the runner's key; the sandbox deadline follows it
    session: bool = True
    # verification
    test_python: str = "python3"  # the interpreter that runs the grader's pytest runner (``python3 -I``)
    test_timeout_s: float = Field(900.0, gt=0)
    protected_paths: tuple[str, ...] = DEFAULT_PROTECTED_PATHS
    scan_diff: bool = True  # a diff that ``diffscan`` flags scores 0 without running the tests
    max_diff_bytes: int = Field(4 << 20, gt=0)  # a larger final diff scores 0
    info_diff_bytes: int = Field(256 << 10, gt=0)  # how much of the diff goes into VerifyResult.info
    info_output_bytes: int = Field(64 << 10, gt=0)  # tail of the test output kept in the info
    info_command_chars: int = Field(2000, gt=0)  # per command-log entry (arguments, output head)
