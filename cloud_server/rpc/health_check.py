"""`cloud-server health`: asks a server's gRPC health service whether it serves, for container
health checks (deploy/): exit 0 when SERVING, 1 with one line on stderr otherwise."""
from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.pb.splitdec.v1 import splitdec_pb2

# Importing no torch keeps a container's periodic check cheap.
SERVICE_NAME = splitdec_pb2.DESCRIPTOR.services_by_name["SplitDecoding"].full_name


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cloud-server health", description=__doc__)
    p.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT (default %(default)s)")
    p.add_argument("--service", default=SERVICE_NAME,
                   help="the service to ask about; '' for the server as a whole "
                        "(default %(default)s)")
    p.add_argument("--timeout", type=float, default=3.0, metavar="S")
    p.add_argument("--tls-ca", metavar="PEM", help="the server speaks TLS: check it against "
                                                   "this CA certificate")
    p.add_argument("--tls-name", metavar="NAME",
                   help="the name the server's certificate carries, when --server reaches it "
                        "by another (a probe dialling 127.0.0.1)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        with _channel(args) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    except grpc.RpcError as err:
        print(f"cloud-server health: {args.server}: {err.code().name.lower()}: {err.details()}",
              file=sys.stderr)
        return 1
    except OSError as err:
        print(f"cloud-server health: {err}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"cloud-server health: {args.server}: {status}", file=sys.stderr)
        return 1
    return 0


def _channel(args: argparse.Namespace) -> grpc.Channel:
    if args.tls_ca is None:
        return grpc.insecure_channel(args.server)
    with open(args.tls_ca, "rb") as f:
        credentials = grpc.ssl_channel_credentials(f.read())
    options = [] if args.tls_name is None else [("grpc.ssl_target_name_override", args.tls_name)]
    return grpc.secure_channel(args.server, credentials, options=options)
