"""``context-engine serve|migrate|inspect|health|hash-token|demo``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from dataclasses import replace

from context_engine.config import Config, ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="context-engine")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_p = sub.add_parser("serve", help="serve gRPC and metrics (the default of `make run`)")
    serve_p.add_argument("--grpc-addr", help="host:port (env CE_GRPC_ADDR; port 0 picks one)")
    serve_p.add_argument("--metrics-addr", help="host:port, empty to disable (CE_METRICS_ADDR)")
    serve_p.add_argument("--workers", type=int, help="serving processes on the one port "
                         "(env CE_WORKERS; default: the number of CPUs)")
    serve_p.add_argument("--dev", action="store_true",
                         help="development mode: no credentials, loopback binds only "
                              "(CE_DEV_MODE=1)")
    sub.add_parser("migrate", help="apply pending migrations and exit")
    token_p = sub.add_parser("hash-token", help="print the SHA-256 of a token read from stdin; "
                                                "with --tenant-id, mint a new token and its "
                                                "CE_AUTH_TOKENS_FILE entry")
    token_p.add_argument("--tenant-id", help="mint a random token bound to this tenant")
    token_p.add_argument("--rpc", action="append",
                         help="an RPC the minted token may call (repeatable; default: all)")
    inspect_p = sub.add_parser("inspect", help="print a session's epochs and recent context "
                                               "events (read-only)")
    from context_engine import inspect

    inspect.add_arguments(inspect_p)
    health_p = sub.add_parser("health", help="probe a running server's grpc.health.v1 "
                                             "(exit 0 when SERVING)")
    from context_engine import healthcheck

    healthcheck.add_arguments(health_p)
    demo_p = sub.add_parser("demo", help="a five-minute tour of a running server: Plan, Build, "
                                         "pressure, Compact, Rotate")
    from context_engine import demo

    demo.add_arguments(demo_p)
    args = parser.parse_args(argv)
    if args.command == "hash-token":  # needs no configuration
        return _hash_token(args)
    if args.command == "health":  # a probe: it needs only the listen address, never the database
        return healthcheck.run(args, os.environ)
    if args.command == "demo":  # a client of a running server: no database, no configuration
        return demo.run(args, os.environ)

    try:
        config = Config.from_env(os.environ)
        if getattr(args, "grpc_addr", None):
            config = replace(config, grpc_addr=args.grpc_addr)
        if getattr(args, "metrics_addr", None) is not None:
            config = replace(config, metrics_addr=args.metrics_addr)
        if getattr(args, "workers", None) is not None:
            if args.workers < 1:
                raise ConfigError(f"--workers={args.workers} must be at least 1")
            config = replace(config, workers=args.workers)
        if getattr(args, "dev", False):
            config = replace(config, dev_mode=True)
        config.validate()
        if args.command == "serve":
            config.validate_serving()
            if config.auth_tokens_file is not None:  # a malformed file fails here, not later
                from context_engine.api.auth import FileTokens

                FileTokens.load(config.auth_tokens_file)
    except ConfigError as exc:
        print(f"context-engine: configuration error: {exc}", file=sys.stderr)
        return 2

    from context_engine.telemetry.logs import configure

    configure(config.log_level)
    if args.command == "serve" and config.dev_mode:
        from context_engine.telemetry.logs import log

        # The first line a dev-mode server prints, so no one mistakes it for a secured one.
        log("dev_mode", logging.WARNING, credentials="none", grpc=config.grpc_addr,
            note="every RPC is accepted without credentials; loopback binds only")
    if args.command == "serve":
        from context_engine.api.workers import WORKER_ENV, supervise

        count = config.worker_count()
        if count > 1 and WORKER_ENV not in os.environ:
            passed = ["--dev"] if getattr(args, "dev", False) else []
            return asyncio.run(supervise(config, count, passed))
        from context_engine.api.server import serve

        asyncio.run(serve(config))
        return 0
    if args.command == "migrate":
        return asyncio.run(_migrate(config))
    if args.command == "inspect":
        return inspect.run(config, args)
    return 2


def _hash_token(args: argparse.Namespace) -> int:
    """Tokens are read from stdin (never argv: it shows in process lists and shell history)."""
    import json
    import secrets

    from context_engine.api.auth import ALL_RPCS, RPC_NAMES, token_sha256

    if args.tenant_id is None:
        token = sys.stdin.readline().strip()
        if not token:
            print("context-engine: hash-token reads a token from stdin", file=sys.stderr)
            return 2
        print(token_sha256(token))
        return 0
    rpcs = args.rpc or [ALL_RPCS]
    unknown = sorted(set(rpcs) - RPC_NAMES - {ALL_RPCS})
    if not args.tenant_id or unknown:
        print(f"context-engine: unknown RPC names {unknown}" if unknown
              else "context-engine: --tenant-id is empty", file=sys.stderr)
        return 2
    token = secrets.token_urlsafe(32)
    print(json.dumps({"token": token,
                      "entry": {"sha256": token_sha256(token), "tenant_id": args.tenant_id,
                                "rpcs": rpcs}}, sort_keys=True))
    return 0


async def _migrate(config: Config) -> int:
    from context_engine.adapters.postgres.migrate import migrate
    from context_engine.api.server import embedded_database_url
    from context_engine.telemetry.logs import log

    url = config.database_url
    if url is None:
        url = await asyncio.to_thread(embedded_database_url, config.data_dir)
    applied = await migrate(url, config.migrations_dir)
    log("migrated", applied=applied)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
