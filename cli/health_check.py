#!/usr/bin/env python3
"""Ask a Baton process's grpc.health.v1.Health whether it is SERVING; exit 0 if so, else 1.

Installed in the image as `baton-health`. docker-compose healthchecks use it (the image has
no grpc_health_probe), and so do the Helm chart's probes when TLS is on (the kubelet's own
gRPC probe cannot speak TLS):

    baton-health --port 50071
    baton-health --port 50071 --tls-dir /etc/baton/tls --server-name baton-decode

With --tls-dir, the server is verified against ca.crt there (the system roots when absent) and
tls.crt/tls.key are presented as this client's certificate (for mutual TLS).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc

try:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
except ImportError:  # the SDK-only install: the servers' extra brings grpcio-health-checking
    health_pb2 = health_pb2_grpc = None


def channel_for(args: argparse.Namespace) -> grpc.Channel:
    target = f"{args.host}:{args.port}"
    if not args.tls_dir:
        return grpc.insecure_channel(target)
    folder = Path(args.tls_dir)

    def read(name: str) -> bytes | None:
        path = folder / name
        return path.read_bytes() if path.is_file() else None

    credentials = grpc.ssl_channel_credentials(root_certificates=read("ca.crt"),
                                               private_key=read("tls.key"), certificate_chain=read("tls.crt"))
    options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
    return grpc.secure_channel(target, credentials, options=options)


def check(args: argparse.Namespace) -> tuple[bool, str]:
    with channel_for(args) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton-health", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--service", default="", help="health service name; empty: the whole server")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    parser.add_argument("--tls-dir", default="", help="folder with ca.crt, tls.crt, tls.key; empty: plaintext")
    parser.add_argument("--server-name", default="", help="name the server certificate must carry")
    args = parser.parse_args(argv)
    if health_pb2 is None:
        print("baton-health needs grpcio-health-checking, part of the server install: "
              "pip install 'baton-serve[server]'", file=sys.stderr)
        return 2
    serving, status = check(args)
    print(f"{args.host}:{args.port} {args.service or '(server)'}: {status}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
