"""`python -m materializer_svc.conformance --target ... --deployment ...`."""

from materializer_svc.conformance.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
