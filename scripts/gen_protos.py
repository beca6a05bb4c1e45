"""Generate omni_serving/v1/*_pb2.py, *_pb2.pyi and *_pb2_grpc.py from protos/.

Run by the build (setup.py) and usable by hand: `python scripts/gen_protos.py`.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def main() -> int:
    import grpc_tools
    from grpc_tools import protoc  # build-time dependency

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "omni_serving" / "v1").glob("*.proto"))
    if not protos:
        print("no .proto files under protos/omni_serving/v1", file=sys.stderr)
        return 1
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={ROOT}",
        f"--pyi_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        *protos,
    ]
    rc = protoc.main(args)
    if rc != 0:
        print(f"protoc failed with exit code {rc}", file=sys.stderr)
        return rc
    # Ship the .proto files beside the generated code (for reflection and users).
    out = ROOT / "omni_serving" / "v1"
    for rel in protos:
        (out / Path(rel).name).write_bytes((PROTO_ROOT / rel).read_bytes())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
