"""python -m pardec.health_probe HOST:PORT [SERVICE]: exit 0 if the server reports SERVING.

For container health checks and scripts, where grpcurl or grpc_health_probe is not installed.
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2:
        print("usage: python -m pardec.health_probe HOST:PORT [SERVICE]", file=sys.stderr)
        return 2
    with grpc.insecure_channel(args[0]) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args[1] if len(args) > 1 else ""), timeout=5
            )
        except grpc.RpcError as error:
            print(f"{args[0]}: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args[0]}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
