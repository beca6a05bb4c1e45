#!/usr/bin/env bash
# The project's whole check: contract lint + breaking check, code lint, types, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
BIN="$VENV/bin"

echo "== buf lint"
(cd protos && "../$BIN/buf" lint)
echo "== buf breaking (against the previous commit)"
if git rev-parse --verify -q HEAD~1 >/dev/null && git cat-file -e HEAD~1:protos/buf.yaml 2>/dev/null; then
  (cd protos && "../$BIN/buf" breaking --against "../.git#ref=HEAD~1,subdir=protos")
else
  echo "no previous commit with protos/: skipped"
fi
echo "== ruff"
"$BIN/ruff" check .
echo "== mypy (typed core)"
"$BIN/mypy"
echo "== pytest"
# --durations: the slowest tests in every run's log (CI time is budgeted)
if [ "$#" -gt 0 ]; then
  "$BIN/python" -m pytest -q --durations=30 "$@"
  exit
fi
# The whole suite in two parts. The tests not marked e2e or vllm (unit tests,
# servers in the test's own process) run on two workers: each uses about one
# core. The tests that start services as processes or run the engine (marked
# e2e or vllm) then run one at a time, as they were measured: their timing
# bounds assume the host is theirs.
# Both parts run whatever the first gives; the status is the first failure's.
UNIT='not e2e and not vllm'
status=0
"$BIN/python" -m pytest -q -n 2 --durations=10 -m "$UNIT" || status=$?
"$BIN/python" -m pytest -q --durations=30 -m "not ($UNIT)" || { [ "$status" -ne 0 ] || status=$?; }
exit "$status"
