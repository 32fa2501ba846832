"""Fixtures of the environment-API tests: a small third-party package (``plugin_pkg``), installed
with pip into a directory of its own, as a user installs a plugin; it registers its
environment through the ``conveyor.environments`` entry point group."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PLUGIN_SOURCE = Path(__file__).parent / "plugin_pkg"


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory) -> Path:
    """The directory the plugin package is installed in (put it on PYTHONPATH / sys.path)."""
    site = tmp_path_factory.mktemp("plugin-site")
    build = tmp_path_factory.mktemp("plugin-build") / "plugin_pkg"
    shutil.copytree(PLUGIN_SOURCE, build)  # setuptools writes its build files beside the source
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(site), str(build)],
        capture_output=True, text=True, timeout=300, cwd=build,
    )
    assert done.returncode == 0, f"pip could not install the test plugin:\n{done.stdout}\n{done.stderr}"
    assert list(site.glob("conveyor_plugin_demo-*.dist-info/entry_points.txt")), "no entry points installed"
    return site


@pytest.fixture
def plugin_on_path(plugin_site, monkeypatch) -> Path:
    monkeypatch.syspath_prepend(str(plugin_site))
    return plugin_site
