"""``context-engine health``: one ``grpc.health.v1.Health/Check`` against a running server.

Exit status 0 when the service reports ``SERVING``; 1 when it reports anything else, cannot be
reached, or does not answer within the timeout; 2 when the probe itself is misconfigured. The
image's ``HEALTHCHECK`` and exec probes run it; it reads only the listen address and how to dial
it, so it never touches the database.

A server run with TLS (``CE_TLS_CERT_FILE``) accepts no plaintext, so without ``--tls-*`` flags
the probe then dials TLS as the ``CE_HEALTH_TLS_*`` variables say (the probe's own settings,
which the server never reads), and refuses to guess when none is set.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from context_engine.config import Config, ConfigError, split_addr

# A server bound to every interface is probed over loopback from inside its own container.
_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1"}

SERVING = 0
NOT_SERVING = 1
USAGE = 2

# How the probe dials a TLS server when no --tls-* flag is given.
HEALTH_TLS_CA_FILE = "CE_HEALTH_TLS_CA_FILE"
HEALTH_TLS_CERT_FILE = "CE_HEALTH_TLS_CERT_FILE"
HEALTH_TLS_KEY_FILE = "CE_HEALTH_TLS_KEY_FILE"
HEALTH_TLS_SERVER_NAME = "CE_HEALTH_TLS_SERVER_NAME"


@dataclass(frozen=True, kw_only=True)
class ProbeTls:
    """TLS settings of the probe; all unset means none was given."""

    ca_file: Path | None = None  # None: the system's trusted roots
    cert_file: Path | None = None  # a client certificate, for mutual TLS
    key_file: Path | None = None
    server_name: str | None = None  # None: the host dialed

    def credentials(self) -> grpc.ChannelCredentials:
        """Channel credentials from the files; ``ConfigError`` when one cannot be read."""

        def read(path: Path | None) -> bytes | None:
            if path is None:
                return None
            try:
                return path.read_bytes()
            except OSError as exc:
                raise ConfigError(f"cannot read {str(path)!r}: {exc.strerror}") from exc

        return grpc.ssl_channel_credentials(root_certificates=read(self.ca_file),
                                            private_key=read(self.key_file),
                                            certificate_chain=read(self.cert_file))


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


def _timeout(text: str) -> float:
    """A probe's timeout: a finite number of seconds above 0 and at most a day. Anything else
    would fail every probe as DEADLINE_EXCEEDED (exit 1, "not serving"), marking a healthy
    server dead; it is a usage error (exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= 86_400:  # nan fails both comparisons
        raise argparse.ArgumentTypeError(f"{text!r}: give more than 0 and at most 86400 "
                                         "seconds")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--grpc-addr", help="the server's gRPC address, host:port (default: "
                                            "CE_GRPC_ADDR; a wildcard host is probed over "
                                            "loopback)")
    parser.add_argument("--service", default="",
                        help="health service name: '' (default) or context_engine.v1.ContextEngine")
    parser.add_argument("--timeout", type=_timeout, default=2.0,
                        help="seconds, more than 0 and at most a day (default 2)")
    parser.add_argument("--tls-ca-file", type=Path,
                        help="dial with TLS, trusting this CA (for a server run with "
                             "CE_TLS_CERT_FILE)")
    parser.add_argument("--tls-cert-file", type=Path,
                        help="client certificate, when the server requires mutual TLS")
    parser.add_argument("--tls-key-file", type=Path, help="the client certificate's key")
    parser.add_argument("--tls-server-name",
                        help="name the server certificate is checked against (default: host)")
    parser.epilog = (f"Without --tls-* flags, a server run with TLS (CE_TLS_CERT_FILE set) is "
                     f"dialed with TLS as {HEALTH_TLS_CA_FILE}, {HEALTH_TLS_CERT_FILE}, "
                     f"{HEALTH_TLS_KEY_FILE} and {HEALTH_TLS_SERVER_NAME} say.")


def _env_path(environ: Mapping[str, str], name: str) -> Path | None:
    raw = environ.get(name)
    return Path(raw) if raw else None


def probe_tls(args: argparse.Namespace, environ: Mapping[str, str]) -> ProbeTls | None:
    """How to dial: the ``--tls-*`` flags when any is given; otherwise, for a server run with TLS
    (``CE_TLS_CERT_FILE``), the ``CE_HEALTH_TLS_*`` variables; otherwise plaintext (None).

    ``ConfigError`` when the server runs TLS and nothing says how to verify it, when it requires
    client certificates and the probe has none, or when a certificate comes without its key."""
    flags = ProbeTls(ca_file=args.tls_ca_file, cert_file=args.tls_cert_file,
                     key_file=args.tls_key_file, server_name=args.tls_server_name)
    if flags != ProbeTls():
        if (flags.cert_file is None) != (flags.key_file is None):
            raise ConfigError("--tls-cert-file and --tls-key-file go together")
        return flags
    if not environ.get("CE_TLS_CERT_FILE"):
        return None
    tls = ProbeTls(ca_file=_env_path(environ, HEALTH_TLS_CA_FILE),
                   cert_file=_env_path(environ, HEALTH_TLS_CERT_FILE),
                   key_file=_env_path(environ, HEALTH_TLS_KEY_FILE),
                   server_name=environ.get(HEALTH_TLS_SERVER_NAME) or None)
    # Dialing plaintext would only ever fail: the port speaks TLS alone.
    if tls == ProbeTls():
        raise ConfigError(f"the server runs TLS (CE_TLS_CERT_FILE is set) but the probe has no "
                          f"TLS settings: set {HEALTH_TLS_CA_FILE} to the CA that signed the "
                          f"server certificate and {HEALTH_TLS_SERVER_NAME} to a name it "
                          f"holds (or pass --tls-ca-file and --tls-server-name)")
    if (tls.cert_file is None) != (tls.key_file is None):
        raise ConfigError(f"{HEALTH_TLS_CERT_FILE} and {HEALTH_TLS_KEY_FILE} go together")
    if environ.get("CE_TLS_CLIENT_CA_FILE") and tls.cert_file is None:
        raise ConfigError(f"the server requires client certificates (CE_TLS_CLIENT_CA_FILE is "
                          f"set): set {HEALTH_TLS_CERT_FILE} and {HEALTH_TLS_KEY_FILE} to one "
                          f"signed by that CA")
    return tls


def run(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """Run the probe for parsed ``health`` arguments; 2 on a usage error."""
    try:
        address = probe_address(args.grpc_addr or environ.get("CE_GRPC_ADDR")
                                or Config().grpc_addr)
        tls = probe_tls(args, environ)
        credentials = tls.credentials() if tls is not None else None
    except ConfigError as exc:
        print(f"context-engine health: {exc}", file=sys.stderr)
        return USAGE
    return check(address, service=args.service, timeout=args.timeout,
                 credentials=credentials, server_name=tls.server_name if tls else None)
