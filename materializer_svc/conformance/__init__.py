"""Conformance kit for MaterializerService implementations.

Run it against any process that serves the contract on a socket:

    python -m materializer_svc.conformance --target unix:///run/m.sock --deployment NAME

The kit owns a shared-memory arena under the deployment's prefix
(`omni-<deployment>`), plays the decoder's part over the wire, and prints one
PASS/FAIL/SKIP line per check. `--list` names the checks and `--explain CHECK`
shows what one sends and expects. From code, `run_conformance(...)` returns
the results as a list.
"""

from materializer_svc.conformance.checks import CheckResult, check_names, run_conformance, summary
from materializer_svc.conformance.cli import main

__all__ = ["CheckResult", "check_names", "main", "run_conformance", "summary"]
