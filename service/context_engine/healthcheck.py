"""``context-engine health``: one ``grpc.health.v1.Health/Check`` against a running server.

Exit status 0 when the service reports ``SERVING``; 1 when it reports anything else, cannot be
reached, or does not answer within the timeout. The image's ``HEALTHCHECK`` and exec probes run
it; it reads no configuration beyond the listen address, so it never touches the database.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from context_engine.config import Config, ConfigError, split_addr

# A server bound to every interface is probed over loopback from inside its own container.
_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1"}

SERVING = 0
NOT_SERVING = 1


def probe_address(grpc_addr: str) -> str:
    """The address to dial for a server listening on ``grpc_addr``."""
    host, port = split_addr(grpc_addr)
    if port == 0:
        raise ConfigError(f"cannot probe {grpc_addr!r}: port 0 is picked at start-up")
    host = _WILDCARDS.get(host, host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check(address: str, *, service: str = "", timeout: float = 2.0,
          credentials: grpc.ChannelCredentials | None = None,
          server_name: str | None = None) -> int:
    """``SERVING`` (0) when ``service`` on ``address`` answers SERVING, else ``NOT_SERVING``."""
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    channel = (grpc.secure_channel(address, credentials, options=options)
               if credentials is not None else grpc.insecure_channel(address))
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as exc:
        code = exc.code() if isinstance(exc, grpc.Call) else None
        print(f"context-engine health: {address}: {code.name if code else exc}",
              file=sys.stderr)
        return NOT_SERVING
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"context-engine health: {address} {service or '(server)'}: {status}")
    return SERVING if reply.status == health_pb2.HealthCheckResponse.SERVING else NOT_SERVING


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--addr", help="host:port to probe (default: CE_GRPC_ADDR, a wildcard "
                                       "host probed over loopback)")
    parser.add_argument("--service", default="",
                        help="health service name: '' (default) or context_engine.v1.ContextEngine")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds (default 2)")
    parser.add_argument("--tls-ca-file", type=Path,
                        help="dial with TLS, trusting this CA (for a server run with "
                             "CE_TLS_CERT_FILE)")
    parser.add_argument("--tls-cert-file", type=Path,
                        help="client certificate, when the server requires mutual TLS")
    parser.add_argument("--tls-key-file", type=Path, help="the client certificate's key")
    parser.add_argument("--tls-server-name",
                        help="name the server certificate is checked against (default: host)")


def run(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """Run the probe for parsed ``health`` arguments; 2 on a usage error."""
    try:
        address = args.addr or probe_address(environ.get("CE_GRPC_ADDR")
                                             or Config().grpc_addr)
        split_addr(address)
    except ConfigError as exc:
        print(f"context-engine health: {exc}", file=sys.stderr)
        return 2
    credentials = None
    if args.tls_ca_file or args.tls_cert_file:
        if bool(args.tls_cert_file) != bool(args.tls_key_file):
            print("context-engine health: --tls-cert-file and --tls-key-file go together",
                  file=sys.stderr)
            return 2
        credentials = grpc.ssl_channel_credentials(
            root_certificates=args.tls_ca_file.read_bytes() if args.tls_ca_file else None,
            private_key=args.tls_key_file.read_bytes() if args.tls_key_file else None,
            certificate_chain=args.tls_cert_file.read_bytes() if args.tls_cert_file else None)
    return check(address, service=args.service, timeout=args.timeout,
                 credentials=credentials, server_name=args.tls_server_name)
