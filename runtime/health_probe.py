"""python -m pardec.runtime.health_probe HOST:PORT [SERVICE] [--tls-ca ...]: exit 0 if the server
reports SERVING.

For container health checks and scripts, where grpcurl or grpc_health_probe is not installed.
Health checking needs no bearer token; a TLS port needs --tls-ca (and, for mutual TLS, a client
certificate).
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pardec.runtime.errors import ConfigError
from pardec.runtime.security import client_tls, open_channel


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pardec.runtime.health_probe")
    parser.add_argument("address", metavar="HOST:PORT")
    parser.add_argument("service", nargs="?", default="")
    parser.add_argument("--tls-ca", help="PEM CA the server's certificate must chain to (connects over TLS)")
    parser.add_argument("--tls-cert", help="PEM client certificate (mutual TLS)")
    parser.add_argument("--tls-key", help="PEM key of --tls-cert")
    args = parser.parse_args(argv)
    try:
        tls = client_tls(args.tls_ca, args.tls_cert, args.tls_key)
    except ConfigError as error:
        print(f"{args.address}: {error}", file=sys.stderr)
        return 2
    with open_channel(args.address, tls) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=5
            )
        except grpc.RpcError as error:
            print(f"{args.address}: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
