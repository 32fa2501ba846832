"""The product code (services, shared) passes mypy with the configuration in pyproject.toml
(``[tool.mypy]``: pydantic's plugin, third-party packages without stubs as Any, the heavy ones
not followed). ``make venv`` installs mypy (the dev extra), so a missing mypy is an incomplete
environment, not a reason to skip. The cache lives in the test's own folder: every run is a
fresh check (about 20-30 s), never an answer left over from an earlier one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MYPY = Path(sys.executable).parent / "mypy"


def test_the_product_code_is_clean_under_the_projects_mypy_configuration(tmp_path):
    assert MYPY.exists(), f"{MYPY} is missing: `make venv` installs it with the dev extra"
    done = subprocess.run([str(MYPY), "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / "cache"),
                           "--no-error-summary", "--hide-error-context", "services", "shared"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
