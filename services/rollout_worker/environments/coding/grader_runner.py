"""Conveyor's trusted pytest runner. NOT imported by Conveyor: the grader copies this file into
the verification sandbox (root-owned, read-only for the sandbox user) and runs it as

    python3 -I RUNNER WORKSPACE NODE_ID... 3>REPORT 4<KEY

- ``-I``: the workspace is not on ``sys.path`` at start-up, and no ``PYTHON*`` variable, user
  site or ``sitecustomize``/``usercustomize`` of the workspace is honoured. pytest, pluggy and the
  standard library are imported first; the workspace is appended to ``sys.path`` after them, so a
  ``pytest.py``, ``_pytest/`` or ``os.py`` in the workspace shadows nothing.
- The configuration is the grader's own (``-c`` an empty ini, ``--rootdir`` and ``--confcutdir``
  the workspace), plugin autoloading is off, and the cache provider is disabled.
- Results go to descriptor 3, a file in a root-only directory that the test process cannot open
  by name, one JSON record per line, each signed with HMAC-SHA256 under the key read from
  descriptor 4 (closed before any test code runs). The last record states pytest's exit status
  and whether pytest's own machinery was replaced while the tests ran (``tampered``).
- The graded test files must keep the contents root hashed before the run (``tests.sha256``):
  checked before each module is collected, after collection and at the end.
- The grader trusts a record set only if every signature checks, the sequence numbers are
  contiguous, the final record is present, its exit status equals the status the root shell
  saw, and nothing was tampered with (see ``grading.read_report``).
"""

import hashlib
import hmac
import json
import os
import sys
from inspect import getattr_static

_KEY = os.read(4, 256).strip()
os.close(4)

import _pytest.main  # noqa: E402
import _pytest.python  # noqa: E402
import _pytest.reports  # noqa: E402
import _pytest.runner  # noqa: E402
import _pytest.skipping  # noqa: E402
import pluggy._callers  # noqa: E402
import pluggy._hooks  # noqa: E402
import pytest  # noqa: E402

_WATCHED = (
    (_pytest.runner, ("call_and_report", "runtestprotocol", "call_runtest_hook", "check_interactive_exception",
                      "pytest_runtest_makereport")),
    (_pytest.runner.CallInfo, ("from_call",)),
    (_pytest.python.Function, ("runtest", "setup")),
    (_pytest.python, ("pytest_pyfunc_call",)),
    (_pytest.reports.TestReport, ("__init__", "from_item_and_call")),
    (_pytest.reports.BaseReport, ("passed", "failed", "skipped")),
    (_pytest.skipping, ("pytest_runtest_makereport", "pytest_report_teststatus")),
    (_pytest.main, ("pytest_runtestloop",)),
    (pluggy._callers, ("_multicall",)),
    (getattr(pluggy._hooks, "_HookCaller", None) or getattr(pluggy._hooks, "HookCaller"), ("__call__", "_hookexec")),
    (os, ("write", "_exit")),
    (hmac, ("new",)),
)


def _internals():
    return tuple(id(getattr_static(owner, name, None)) for owner, names in _WATCHED for name in names)


def _make_writer(key, fd, dumps, new, sha256):
    seq = [0]

    def write(record):
        record = dict(record, seq=seq[0])
        body = dumps(record, sort_keys=True)
        line = body + " " + new(key, body.encode(), sha256).hexdigest() + "\n"
        os.write(fd, line.encode())
        seq[0] += 1
    return write


def _trusted_module(plugin):
    """A conftest.py (protected: the repository's own) or a module installed outside the workspace."""
    where = getattr(plugin, "__file__", None)
    if not isinstance(where, str) or type(plugin).__name__ != "module":
        return False
    real = os.path.realpath(where)
    return real.endswith("/conftest.py") or not real.startswith(os.path.realpath(os.getcwd()) + "/")


def _expected_hashes():
    """``sha256sum`` of the graded test files, written by root before the run (``tests.sha256``)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests.sha256")
    hashes = {}
    with open(path) as listing:
        for line in listing:
            digest, _, name = line.rstrip("\n").partition("  ")
            hashes[name] = digest
    return hashes


def _sha256(path):
    try:
        with open(path, "rb") as source:
            return hashlib.sha256(source.read()).hexdigest()
    except OSError:
        return None


class Guard:
    """Records every test phase's outcome as pytest reports it, and watches pytest's machinery,
    the test functions' origin, the graded test files' contents and trace hooks."""

    def __init__(self, write, snapshot, hashes):
        self._write, self._snapshot, self._hashes = write, snapshot, hashes
        self._plugins = None

    def _check_files(self, stage):
        for name, digest in self._hashes.items():
            if _sha256(name) != digest:
                self._write({"kind": "test_file_changed", "path": name, "stage": stage})

    @pytest.hookimpl(tryfirst=True)
    def pytest_pycollect_makemodule(self, module_path, parent):
        self._check_files(f"before collecting {module_path}")

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_finish(self, session):
        self._check_files("after collection")

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection(self, session):
        self._plugins = {id(p) for p in session.config.pluginmanager.get_plugins()}

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_call(self, item):
        code = getattr(getattr(item, "obj", None), "__code__", None)
        where = os.path.realpath(code.co_filename) if code else ""
        if where != os.path.realpath(str(item.path)):
            self._write({"kind": "foreign_test", "nodeid": item.nodeid, "code": where})
        yield
        if sys.gettrace() is not None or sys.getprofile() is not None:  # e.g. a tracer that jumps lines
            self._write({"kind": "foreign_test", "nodeid": item.nodeid, "code": "a trace or profile hook"})

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report):
        self._write({"kind": "phase", "nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                     "xfail": bool(getattr(report, "wasxfail", None) is not None)})

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        plugins = session.config.pluginmanager.get_plugins()
        added = [repr(p)[:200] for p in plugins if id(p) not in (self._plugins or set()) and not _trusted_module(p)]
        self._check_files("at the end")
        changed = _internals() != self._snapshot
        self._write({"kind": "finish", "exitstatus": int(exitstatus), "tampered": changed, "plugins_added": added})


def main():
    global _KEY
    snapshot = _internals()
    write = _make_writer(_KEY, 3, json.dumps, hmac.new, hashlib.sha256)
    _KEY = None  # only the writer's closure keeps it
    workspace, node_ids = sys.argv[1], sys.argv[2:]
    os.chdir(workspace)
    hashes = _expected_hashes()
    ini = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pytest.ini")
    sys.path.append(workspace)
    args = ["-c", ini, "--rootdir", workspace, "--confcutdir", workspace, "-p", "no:cacheprovider",
            "-p", "no:pytester", "-rA", "--tb=short", "-q", *node_ids]
    status = pytest.main(args, plugins=[Guard(write, snapshot, hashes)])
    sys.stdout.flush()
    os._exit(int(status))


if __name__ == "__main__":
    main()
