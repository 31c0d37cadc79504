"""``context-engine serve|migrate``."""

from __future__ import annotations

import argparse
import asyncio
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
    sub.add_parser("migrate", help="apply pending migrations and exit")
    inspect_p = sub.add_parser("inspect", help="print a session's epochs and recent context "
                                               "events (read-only)")
    from context_engine import inspect

    inspect.add_arguments(inspect_p)
    health_p = sub.add_parser("health", help="probe a running server's grpc.health.v1 "
                                             "(exit 0 when SERVING)")
    from context_engine import healthcheck

    healthcheck.add_arguments(health_p)
    args = parser.parse_args(argv)
    if args.command == "health":  # a probe: it needs only the listen address, never the database
        return healthcheck.run(args, os.environ)

    try:
        config = Config.from_env(os.environ)
        if getattr(args, "grpc_addr", None):
            config = replace(config, grpc_addr=args.grpc_addr)
        if getattr(args, "metrics_addr", None) is not None:
            config = replace(config, metrics_addr=args.metrics_addr)
        config.validate()
    except ConfigError as exc:
        print(f"context-engine: configuration error: {exc}", file=sys.stderr)
        return 2

    from context_engine.telemetry.logs import configure

    configure(config.log_level)
    if args.command == "serve":
        from context_engine.api.server import serve

        asyncio.run(serve(config))
        return 0
    if args.command == "migrate":
        return asyncio.run(_migrate(config))
    if args.command == "inspect":
        return inspect.run(config, args)
    return 2


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
