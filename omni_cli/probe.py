"""`python -m omni_cli.probe TARGET`: one grpc.health.v1 Check; exit 0 when SERVING.

The container healthcheck of the three services (docker/compose.yaml): it
ships with the package, so the image needs no health-probe binary.

    python -m omni_cli.probe unix:///run/omni-serving/decoder.sock
    python -m omni_cli.probe 127.0.0.1:50051 --service omni_serving.v1.OmniGatewayService

Exit status: 0 SERVING, 1 anything else (NOT_SERVING, no answer, error).
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omni_common.errors import InvalidArgumentError
from omni_common.server import client_target


def check(target: str, service: str = "", timeout_s: float = 3.0) -> str:
    """The health status name of `service` at `target` (SERVING, NOT_SERVING, ...).

    Raises grpc.RpcError when there is no answer within timeout_s.
    """
    with grpc.insecure_channel(client_target(target)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_cli.probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="unix:///abs/path.sock or host:port")
    parser.add_argument("--service", default="", help="service name to check (default: the server as a whole)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    try:
        status = check(args.target, args.service, args.timeout)
    except InvalidArgumentError as exc:
        parser.error(str(exc))
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        print(f"{args.target}: {getattr(code, 'name', code)}: {details}", file=sys.stderr)
        return 1
    print(f"{args.target}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
