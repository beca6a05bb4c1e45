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
"$BIN/python" -m pytest -q --durations=30 "$@"
