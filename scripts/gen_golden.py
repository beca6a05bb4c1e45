"""Generate the conformance kit's golden vectors (materializer_svc/conformance/golden/).

    python scripts/gen_golden.py                # write materializer_svc/conformance/golden/
    python scripts/gen_golden.py --check        # exit 1 if the files are stale
    python scripts/gen_golden.py --out DIR      # write elsewhere

The scenarios and the expected answers come from
materializer_svc.conformance.vectors (fixed seeds, omni_common.materialize.build_step);
running this twice gives identical bytes.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from materializer_svc.conformance.vectors import write_golden

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "materializer_svc" / "conformance" / "golden"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})"
    )
    p.add_argument("--check", action="store_true", help="compare with --out instead of writing")
    args = p.parse_args(argv)
    if not args.check:
        for path in write_golden(args.out):
            print(f"wrote {path} ({path.stat().st_size} bytes)")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = write_golden(tmp)
        stale = [
            f.name
            for f in fresh
            if not (args.out / f.name).exists()
            or not filecmp.cmp(f, args.out / f.name, shallow=False)
        ]
    extra = (
        sorted({p.name for p in args.out.glob("*")} - {f.name for f in fresh})
        if args.out.exists()
        else []
    )
    if stale or extra:
        print(
            f"golden vectors in {args.out} are stale: differ {stale}, unexpected {extra}; run scripts/gen_golden.py"
        )
        return 1
    print(f"golden vectors in {args.out} are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
