"""The product code, the benchmarks and the tests pass ruff with the rules pyproject.toml selects
(``[tool.ruff.lint]``: pyflakes, syntax errors, bugbear). ``make venv`` installs ruff (the dev
extra), so a missing ruff is an incomplete environment, not a reason to skip."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUFF = Path(sys.executable).parent / "ruff"


def test_the_code_and_its_tests_are_clean_under_the_projects_ruff_rules():
    assert RUFF.exists(), f"{RUFF} is missing: `make venv` installs it with the dev extra"
    done = subprocess.run([str(RUFF), "check", "--no-cache", "--output-format", "concise", "services", "shared", "bench", "tests"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
