#!/usr/bin/env bash
# Runs pytest. Exit code 5 (no tests collected) is a failure here on purpose:
# a test run that collects nothing has tested nothing.
set -u
PY=$1; shift
"$PY" -m pytest "$@"
rc=$?
if [ $rc -eq 5 ]; then
  echo "run_tests: pytest collected no tests; treating that as a failure" >&2
  exit 1
fi
exit $rc
