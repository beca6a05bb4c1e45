"""Command line of the conformance kit (also `omni-serving conformance`)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

import grpc

from materializer_svc.conformance.checks import CheckResult, check_names, run_conformance, summary
from omni_common.errors import OmniError
from omni_common.server import wait_for_health_sync


def build_parser(prog: str = "python -m materializer_svc.conformance") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Check a MaterializerService implementation against the omni_serving.v1 contract.",
    )
    p.add_argument(
        "--target", help="address of the implementation: unix:///abs/path.sock or host:port"
    )
    p.add_argument(
        "--deployment",
        help="deployment name the implementation serves (arena prefix omni-<deployment>)",
    )
    p.add_argument(
        "--golden",
        default=None,
        help="directory with manifest.json (default: the vectors shipped with the kit)",
    )
    p.add_argument(
        "--strict-messages",
        action="store_true",
        help="also require each bad-step StepError message to contain its check's phrase "
        "(case-insensitive; the table is in docs/writing-a-materializer.md, or see --explain CHECK)",
    )
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="PREFIX",
        help="run only checks whose name starts with PREFIX (repeatable)",
    )
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for any one answer")
    p.add_argument(
        "--wait", type=float, default=10.0, help="seconds to wait for the target to report SERVING"
    )
    p.add_argument(
        "--json", metavar="FILE", help="also write the results as JSON to FILE ('-' for stdout)"
    )
    p.add_argument("--list", action="store_true", help="list the checks and exit")
    p.add_argument(
        "--explain",
        metavar="CHECK",
        help="print what CHECK (a name from --list, or a prefix of names) sends and expects, and exit",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the kit; 0 if every check passed, 1 if one failed, 2 on usage errors."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(check_names()))
        return 0
    if args.explain:
        from materializer_svc.conformance.explain import explain

        try:
            print(
                explain(
                    args.explain, deployment=args.deployment or "explain", golden_dir=args.golden
                )
            )
        except KeyError:
            print(
                f"error: no check is named {args.explain!r} or starts with it (see --list)",
                file=sys.stderr,
            )
            return 2
        return 0
    if not args.target or not args.deployment:
        parser.print_usage(sys.stderr)
        print("error: --target and --deployment are required", file=sys.stderr)
        return 2
    try:
        wait_for_health_sync(args.target, args.wait)
    except OmniError as exc:
        print(f"FAIL  connect  {exc}", flush=True)
        print(summary([CheckResult("connect", False, str(exc))]), flush=True)
        return 1

    def show(result: CheckResult) -> None:
        print(result.line(), flush=True)

    try:
        results = run_conformance(
            args.target,
            args.deployment,
            golden_dir=args.golden,
            strict_messages=args.strict_messages,
            timeout_s=args.timeout,
            only=args.only or None,
            on_result=show,
        )
    except grpc.RpcError as exc:
        results = [CheckResult("connect", False, f"{exc.code()}: {exc.details()}")]
        show(results[0])
    except OmniError as exc:  # the kit's own arena could not be created, for example
        results = [CheckResult("setup", False, str(exc))]
        show(results[0])
    print(summary(results), flush=True)
    if args.json:
        text = json.dumps([asdict(r) for r in results], indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0 if results and all(r.passed for r in results) else 1
