"""``context-engine serve|migrate|config|inspect|purge-tenant|health|hash-token|demo`` and
``--version``."""

from __future__ import annotations

import os
import signal
import sys


def _interrupted_while_loading(signum: int, frame: object) -> None:
    """Ctrl-C while the command's modules load, before ``main`` can catch it: one line and
    the shell's code for SIGINT (nothing has started that needs stopping)."""
    os.write(2, b"context-engine: interrupted\n")
    os._exit(130)


class Terminated(BaseException):
    """SIGTERM before a command installs its own handling of it (a server still starting):
    raised where the program is, so that what it started (the embedded PostgreSQL) is stopped
    on the way out, as for Ctrl-C. A BaseException: no ``except Exception`` swallows it."""


class HungUp(Terminated):
    """SIGHUP alike (the terminal closed while a server still started)."""


def _terminated(signum: int, frame: object) -> None:
    raise HungUp if signum == signal.SIGHUP else Terminated


def _the_program() -> bool:
    """Whether this process is context-engine itself: ``python -m context_engine`` (its
    ``__main__`` module is ours), or the console script (a ``__main__`` of no module, named
    context-engine), not a program that imports cli (``python -m pytest``)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None:
        return bool(spec.name == "context_engine.__main__")
    return os.path.basename(sys.argv[0]) == "context-engine"


# First, before the modules that take a while to load; only as the program.
if _the_program() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted_while_loading)

import argparse  # noqa: E402
import asyncio  # noqa: E402
import errno  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
from collections.abc import Callable, Mapping, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

from context_engine.config import (  # noqa: E402
    Config,
    ConfigError,
    redact_message,
    redact_url,
    split_addr,
    unknown_variables,
)

if TYPE_CHECKING:
    from context_engine.adapters.postgres.migrate import (
        DatabaseUnreachable,
        Entry,
        MigrationFailed,
    )
    from context_engine.domain.ports import Erased

PROG = "context-engine"
DISTRIBUTION = "context-engine"  # the installed package (pyproject.toml [project] name)


def versions(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """What ``--version`` prints: the service, the contract, the platform policy assets and
    the request builder.

    The contract has no version constant: the proto package (``context_engine.v1``) is its
    major version, and the SHA-256 of the compiled file descriptor the generated code embeds
    (the same bytes server reflection serves) names the exact contract; comments do not change
    it. The policy version is the one ``Plan`` pins: the ``manifest.json`` of ``CE_ASSETS_DIR``
    when set, else of the packaged assets."""
    from importlib.metadata import PackageNotFoundError, version

    from context_engine import __version__
    from context_engine.adapters.assets import DEFAULT_ASSETS_DIR, load_platform_assets
    from context_engine.domain.plan import BUILDER_VERSION
    from context_engine.v1 import context_engine_pb2 as pb

    try:
        service = version(DISTRIBUTION)
    except PackageNotFoundError:  # imported from a source tree that was never installed
        service = f"{__version__} (not installed)"
    descriptor = hashlib.sha256(pb.DESCRIPTOR.serialized_pb).hexdigest()
    assets_dir = environ.get("CE_ASSETS_DIR")
    try:
        policy = load_platform_assets(Path(assets_dir) if assets_dir
                                      else DEFAULT_ASSETS_DIR).version
    except (OSError, ValueError, KeyError) as exc:
        policy = f"unreadable ({type(exc).__name__}: {exc})"
    if assets_dir:
        policy += f" (CE_ASSETS_DIR={assets_dir})"
    return [(PROG, service),
            ("contract", f"{pb.DESCRIPTOR.package} sha256:{descriptor}"),
            ("policy", policy),
            ("builder", BUILDER_VERSION)]


class _Version(argparse.Action):
    """``--version``, computed only when asked (it imports the generated code)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the service, contract, policy and builder versions")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        print("\n".join(f"{key:<15} {value}" for key, value in versions(os.environ)))
        parser.exit()


def main(argv: list[str] | None = None) -> int:
    """The command line. A reader that stops early (``| head``) ends it quietly, exit 1, as
    Python's own advice for SIGPIPE has it: no traceback for a pipe closed by its reader; nor
    for Ctrl-C, exit 130."""
    if signal.getsignal(signal.SIGINT) is _interrupted_while_loading:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # loaded: caught below
    from context_engine.api.workers import WORKER_ENV

    # until serve handles it: caught below. Not in a worker, which starts nothing that
    # outlives it (its supervisor owns the embedded database) and is stopped at once.
    if _the_program() and WORKER_ENV not in os.environ:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                signal.signal(sig, _terminated)
    try:
        code = _main(argv)
        sys.stdout.flush()  # inside: a pipe closed meanwhile fails here, not at exit
        return code
    except BrokenPipeError:
        # what is still buffered for stdout goes nowhere, not into a second error at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        # Ctrl-C before a command's own handling of it (a server still starting, a prompt):
        # one line, and the shell's code for SIGINT, not a traceback
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except HungUp:  # the terminal closed: as SIGTERM, with the shell's code for SIGHUP
        print(f"{PROG}: hung up", file=sys.stderr)
        return 129
    except Terminated:  # SIGTERM alike: what was started stops on the way out (atexit)
        print(f"{PROG}: terminated", file=sys.stderr)
        return 143


def _unreachable(exc: DatabaseUnreachable, config: Config) -> str:
    """Why a command's first connection failed, and where it went: a URL that cannot be used,
    a server that refused it (its user, password or database), or one not reached in time."""
    where = ("DATABASE_URL " + redact_url(config.database_url)
             if config.database_url is not None
             else f"the embedded PostgreSQL under {config.data_dir}")
    detail = str(exc) if config.database_url is None else redact_message(str(exc),
                                                                         config.database_url)
    if exc.misconfigured:
        return f"cannot use the database URL ({where}): {detail}"
    if exc.setting:
        return (f"the database refused a setting the URL asks for ({where}): {detail}: "
                "each URL parameter asyncpg does not take itself (libpq's connect_timeout, "
                "for one) reaches the server as a setting, and PgBouncer refuses those it "
                "does not track; remove or correct it (CE_DB_TIMEOUT_SECONDS bounds "
                "connecting)")
    if exc.refused:
        return (f"the database refused the connection ({where}): {detail}: check the user, "
                "the password and the database name")
    return (f"cannot reach the database ({where}): {detail} "
            f"(CE_DB_TIMEOUT_SECONDS={config.db_timeout_seconds:g} s to connect)")


def _migration_failed(exc: MigrationFailed, config: Config, *, reading: bool = False) -> str:
    """What failed while migrating (``reading``: while ``migrate --status`` read what is
    applied), what of it is applied, and what to do."""
    where = ("DATABASE_URL " + redact_url(config.database_url)
             if config.database_url is not None
             else f"the embedded PostgreSQL under {config.data_dir}")
    detail = (exc.detail if config.database_url is None
              else redact_message(exc.detail, config.database_url))
    before = ", ".join(exc.applied) if exc.applied else "none"
    if reading:
        return f"cannot read the applied migrations ({where}): {detail}"
    if exc.migration is None:
        return f"cannot migrate ({where}): {detail}; nothing was applied"
    if exc.committing:
        return (f"migration {exc.migration} failed while committing ({where}): {detail}; "
                f"whether it was applied is unknown (`{PROG} migrate --status` tells); "
                f"applied before it by this run: {before}; run `{PROG} migrate` again: it "
                f"applies {exc.migration} if it was not")
    return (f"migration {exc.migration} failed ({where}): {detail}; it was not applied "
            f"(its transaction did not commit); applied before it by this run: {before}; "
            f"fix the cause and run `{PROG} migrate` again: it resumes at {exc.migration}")


def _tenant_problem(tenant: str, *, erasing: bool = False) -> str | None:
    """What makes ``tenant`` no tenant id, by the rule every request's tenant_id is held to
    (hash-token: a token minted for another id could call nothing), or, ``erasing``
    (purge-tenant), by the earlier rule, so that a tenant stored under an id it accepted can
    still be erased."""
    from context_engine.domain.identifiers import erasable_identifier_problem, identifier_problem

    problem = (erasable_identifier_problem if erasing else identifier_problem)(tenant)
    return None if problem is None else f"--tenant-id {problem}"


def _main(argv: list[str] | None) -> int:
    args = parser().parse_args(argv)
    return _command(args)


def parser() -> argparse.ArgumentParser:
    """Every command and its arguments."""
    parser = argparse.ArgumentParser(prog=PROG)
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)
    serve_p = sub.add_parser("serve", help="serve gRPC and metrics (the default of `make run`)")
    serve_p.add_argument("--grpc-addr", help="host:port (env CE_GRPC_ADDR; port 0 picks one)")
    serve_p.add_argument("--metrics-addr", help="host:port, empty to disable (CE_METRICS_ADDR)")
    serve_p.add_argument("--workers", type=int, help="serving processes on the one port "
                         "(env CE_WORKERS, 0 to 1024; 0, the default: one per CPU)")
    serve_p.add_argument("--dev", action="store_true",
                         help="development mode: no credentials, loopback binds only "
                              "(CE_DEV_MODE=1)")
    migrate_p = sub.add_parser("migrate", help="apply pending migrations and exit")
    migrate_p.add_argument("--status", action="store_true",
                           help="list applied and pending migrations, applying nothing "
                                "(exit 1 when an applied one no longer matches its file)")
    config_p = sub.add_parser("config", help="print the effective configuration (secrets "
                                             "redacted) and where each setting came from")
    config_p.add_argument("--json", action="store_true", help="print one JSON document")
    token_p = sub.add_parser("hash-token", help="print the SHA-256 of a token read from stdin; "
                                                "with --tenant-id, mint a new token and its "
                                                "CE_AUTH_TOKENS_FILE entry")
    token_p.add_argument("--tenant-id", "--tenant", help="mint a random token bound to this "
                                                        "tenant")
    token_p.add_argument("--rpc", action="append",
                         help="an RPC the minted token may call (repeatable; default: all)")
    inspect_p = sub.add_parser("inspect", help="print a session's epochs and recent context "
                                               "events (read-only)")
    from context_engine import inspect

    inspect.add_arguments(inspect_p)
    purge_p = sub.add_parser("purge-tenant", allow_abbrev=False,
                             help="erase every session of a tenant and its estimator "
                                  "calibrations (its API tokens are kept), recording one audit "
                                  "row; asks to type the tenant id unless --yes")
    purge_p.add_argument("--tenant-id", "--tenant", required=True, help="the tenant to erase")
    purge_p.add_argument("--yes", action="store_true",
                         help="do not ask for confirmation (scripts)")
    purge_p.add_argument("--json", action="store_true", help="print the counts as one JSON "
                                                             "document")
    purge_p.add_argument("--batch-size", type=int, default=500,
                         help="sessions erased per transaction (default 500; 1 to "
                              "2147483647)")
    health_p = sub.add_parser("health", help="probe a running server's grpc.health.v1 "
                                             "(exit 0 when SERVING)")
    from context_engine import healthcheck

    healthcheck.add_arguments(health_p)
    # No abbreviations: `--token` must not quietly mean --token-stdin.
    demo_p = sub.add_parser("demo", allow_abbrev=False,
                            help="a five-minute tour of a running server: Plan, Build, "
                                 "pressure, Compact, Rotate")
    from context_engine import demo

    demo.add_arguments(demo_p)
    return parser


def _command(args: argparse.Namespace) -> int:
    if args.command == "hash-token":  # needs no configuration
        return _hash_token(args)
    if args.command == "health":  # a probe: it needs only the listen address, never the database
        from context_engine import healthcheck

        return healthcheck.run(args, os.environ)
    if args.command == "demo":  # a client of a running server: no database, no configuration
        from context_engine import demo

        return demo.run(args, os.environ)

    try:
        config = Config.from_env(os.environ)
        if args.command != "serve":  # serve logs them, after its first line
            for line in unknown_variables(os.environ):
                print(f"{PROG}: warning: {line}", file=sys.stderr)
        if args.command == "config":
            return _emit(_show_config(config, as_json=args.json))
        flags: dict[str, tuple[str, Any]] = {}
        if getattr(args, "grpc_addr", None):
            flags["grpc_addr"] = ("--grpc-addr", args.grpc_addr)
        if getattr(args, "metrics_addr", None) is not None:
            flags["metrics_addr"] = ("--metrics-addr", args.metrics_addr)
        if getattr(args, "workers", None) is not None:  # 0: one per CPU, as CE_WORKERS
            flags["workers"] = ("--workers", args.workers)
        if getattr(args, "dev", False):
            flags["dev_mode"] = ("--dev", True)
        config = config.with_flags(flags)  # validated like the variables
        if args.command == "migrate":
            config.validate_migrations()
        if args.command == "serve":
            config.validate_serving()
            _raise_unreadable_files(config)
            if config.auth_tokens_file is not None:  # a malformed file fails here, not later
                from context_engine.api.auth import FileTokens
                from context_engine.telemetry.logs import LOGGER

                # checked only: its warnings are logged when the server loads it, as JSON
                # lines (here, before logging is set up, one reached stderr as a bare word)
                disabled, LOGGER.disabled = LOGGER.disabled, True
                try:
                    tokens = FileTokens.load(config.auth_tokens_file)
                finally:
                    LOGGER.disabled = disabled
                if not len(tokens) and not config.auth_db_tokens:
                    raise ConfigError(
                        f"CE_AUTH_TOKENS_FILE={str(config.auth_tokens_file)!r} holds no token "
                        "and CE_AUTH_DB_TOKENS is off: every call would be refused; mint one "
                        "with `context-engine hash-token --tenant-id <tenant>`")
    except ConfigError as exc:
        print(f"{PROG}: configuration error: {exc}", file=sys.stderr)
        return 2

    from context_engine.adapters.postgres.migrate import (
        DatabaseUnreachable,
        MigrationError,
        MigrationFailed,
    )
    from context_engine.api.server import EmbeddedDatabaseFailed
    from context_engine.telemetry.logs import configure

    configure(config.log_level)
    try:
        return _run(args, config)
    except EmbeddedDatabaseFailed as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except DatabaseUnreachable as exc:  # the first connection of serve or migrate
        print(f"{PROG}: {_unreachable(exc, config)}; nothing was applied", file=sys.stderr)
        return 1
    except MigrationError as exc:  # an applied migration no longer matches its file
        print(f"{PROG}: refusing to start: the applied migrations do not match "
              f"{config.migrations_dir}:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    except MigrationFailed as exc:  # a migration's SQL, a privilege, the connection lost
        print(f"{PROG}: {_migration_failed(exc, config)}", file=sys.stderr)
        return 1


def _raise_unreadable_files(config: Config) -> None:
    """The model catalog, the platform assets and the summarizer's prompt, read as ``serve``
    reads them, before anything starts: one that cannot be read (not JSON, the wrong shape, a
    file missing) ended in a traceback once the database was migrated."""
    from context_engine.adapters.assets import (
        load_control_tools,
        load_model_catalog,
        load_platform_assets,
    )
    from context_engine.adapters.summarizer import load_prompt
    from context_engine.api.server import described

    checks: list[tuple[str, Path, Callable[[Path], object]]] = [
        ("CE_MODEL_CATALOG", config.model_catalog, load_model_catalog),
        ("CE_ASSETS_DIR", config.assets_dir, load_platform_assets),
        ("CE_ASSETS_DIR", config.assets_dir, load_control_tools)]
    if config.summarizer_url:
        checks.append(("CE_ASSETS_DIR", config.assets_dir, load_prompt))
    problems = []
    for variable, path, load in checks:
        try:
            load(path)
        except (OSError, ValueError, KeyError, TypeError, AttributeError,
                RecursionError) as exc:  # the last: JSON nested past the parser's limit
            problems.append(f"{variable}={str(path)!r} cannot be read: {described(exc)}")
    if problems:
        raise ConfigError("; ".join(dict.fromkeys(problems)))


def _serve(args: argparse.Namespace, config: Config) -> int:
    """``serve``: the addresses checked and held, then one process or a supervisor."""
    from context_engine.api.workers import (
        WORKER_ENV,
        hold_address,
        port_taken,
        remove_abandoned_directories,
        supervise,
    )

    if WORKER_ENV not in os.environ:  # a worker binds the port its supervisor holds
        # named as the operator gave it: a flag, else its variable
        for setting, addr in (
                ("--grpc-addr" if getattr(args, "grpc_addr", None) else "CE_GRPC_ADDR",
                 config.grpc_addr),
                ("--metrics-addr" if getattr(args, "metrics_addr", None) is not None
                 else "CE_METRICS_ADDR", config.metrics_addr)):
            if not addr:
                continue
            host, port = split_addr(addr)
            # held from here until the server stops: another server starting meanwhile is
            # refused here, though its port check and this one both found the port free
            taken = hold_address(host, port) or port_taken(host, port)
            if taken is not None:
                hint = ("is a server already running there? Stop it, or choose another "
                        "address" if taken.errno == errno.EADDRINUSE else
                        "choose an address this machine can bind")
                print(f"{PROG}: cannot serve on {addr} ({setting}): "
                      f"{taken.strerror or taken}; {hint}", file=sys.stderr)
                return 2
        remove_abandoned_directories()  # what supervisors killed outright left
    count = config.worker_count()
    if count > 1 and WORKER_ENV not in os.environ:
        passed = ["--dev"] if getattr(args, "dev", False) else []
        return asyncio.run(supervise(config, count, passed))
    from context_engine.api.server import serve

    asyncio.run(serve(config))
    return 0


def _run(args: argparse.Namespace, config: Config) -> int:
    from context_engine.api.workers import WORKER_ENV
    from context_engine.telemetry.logs import log, log_always

    if args.command == "serve" and WORKER_ENV in os.environ:
        log("worker_starting", worker=os.environ[WORKER_ENV], pid=os.getpid())
    elif args.command == "serve":  # by the supervisor (or the one process), not each worker
        if config.dev_mode:
            # The first line a dev-mode server prints, so no one mistakes it for a secured one.
            # Printed whatever CE_LOG_LEVEL says (an ERROR level silenced it: a server taking
            # every call without credentials, said nowhere), as the unknown variables are.
            log_always("dev_mode", logging.WARNING, credentials="none", grpc=config.grpc_addr,
                       note="every RPC is accepted without credentials; loopback binds only")
        for line in unknown_variables(os.environ):
            log_always("unknown_variable", logging.WARNING, problem=line)
    if args.command == "serve":
        from context_engine.api.workers import release_addresses

        try:
            return _serve(args, config)
        finally:
            release_addresses()
    if args.command == "migrate":
        if args.status:
            return asyncio.run(_migration_status(config))
        return asyncio.run(_migrate(config))
    if args.command == "inspect":
        from context_engine import inspect

        return inspect.run(config, args)
    if args.command == "purge-tenant":
        return _purge_tenant(config, args)
    return 2


# ---------------------------------------------------------------------------- config


def _emit(text: str) -> int:
    """Prints ``text``; a reader that stops early (``| head``) is not an error."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # the interpreter flushes stdout again at exit: point it at nothing first
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _show_config(config: Config, *, as_json: bool) -> str:
    from context_engine.config import effective

    settings = effective(config)
    if as_json:
        return json.dumps({s.name: {"value": s.value, "variable": s.variable, "source": s.source}
                           for s in settings}, indent=2)
    rows = [("setting", "variable", "source", "value")]
    rows += [(s.name, s.variable, s.source,
              "(unset)" if s.value is None else json.dumps(s.value)
              if isinstance(s.value, bool) else str(s.value)) for s in settings]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}"
                     .rstrip() for r in rows)


# ---------------------------------------------------------------------------- hash-token


def _hash_token(args: argparse.Namespace) -> int:
    """Tokens are read from stdin (never argv: it shows in process lists and shell history)."""
    import secrets

    from context_engine.api.auth import ALL_RPCS, RPC_NAMES, token_sha256

    if args.tenant_id is None:
        if args.rpc:  # it says what a minted token may call: there is none without a tenant
            print(f"{PROG}: --rpc goes with --tenant-id (it names what a minted token may "
                  "call); without --tenant-id, hash-token hashes a token from stdin",
                  file=sys.stderr)
            return 2
        token = sys.stdin.readline().strip()
        if not token:
            print(f"{PROG}: hash-token reads a token from stdin", file=sys.stderr)
            return 2
        print(token_sha256(token))
        return 0
    rpcs = list(dict.fromkeys(args.rpc or [ALL_RPCS]))  # a name given twice, once
    unknown = sorted(set(rpcs) - RPC_NAMES - {ALL_RPCS})
    problem = (f"unknown RPC names {unknown}" if unknown
               # a token that only erases may name a tenant stored under the earlier rule
               else _tenant_problem(args.tenant_id, erasing=rpcs == ["DeleteSession"])
               or (f"--rpc {ALL_RPCS} (every RPC) goes alone" if ALL_RPCS in rpcs
                   and len(rpcs) > 1 else None))
    if problem is not None:
        print(f"{PROG}: {problem}", file=sys.stderr)
        return 2
    token = secrets.token_urlsafe(32)
    print(json.dumps({"token": token,
                      "entry": {"sha256": token_sha256(token), "tenant_id": args.tenant_id,
                                "rpcs": rpcs}}, sort_keys=True))
    return 0


# ---------------------------------------------------------------------------- purge-tenant

PURGE_REQUESTED_BY = "operator-cli"
BATCH_SIZE_MAX = 2_147_483_647  # as inspect's --events and --epoch


def _purge_tenant(config: Config, args: argparse.Namespace) -> int:
    """Exit 0 purged (or nothing to purge), 1 not confirmed or the database unreachable,
    2 bad arguments."""
    tenant = args.tenant_id
    problem = _tenant_problem(tenant, erasing=True)
    if problem is not None:
        print(f"{PROG}: {problem}", file=sys.stderr)
        return 2
    if args.batch_size < 1:
        print(f"{PROG}: --batch-size must be at least 1", file=sys.stderr)
        return 2
    if args.batch_size > BATCH_SIZE_MAX:  # a LIMIT PostgreSQL cannot bind ends in a traceback
        print(f"{PROG}: --batch-size must be at most {BATCH_SIZE_MAX}", file=sys.stderr)
        return 2
    if not args.yes:
        print(f"This erases every session of tenant {tenant!r} (plans, context events, "
              "compactions, usage rows, idempotency keys) and its estimator calibrations. "
              "It cannot be undone.\nType the tenant id to confirm: ", end="", file=sys.stderr,
              flush=True)
        typed = sys.stdin.readline().rstrip("\r\n")
        if typed != tenant:
            print(f"{PROG}: not confirmed; nothing was erased", file=sys.stderr)
            return 1
    import asyncpg

    from context_engine.adapters.postgres.migrate import DatabaseUnreachable
    from context_engine.api.server import described, embedded_exists
    from context_engine.domain.errors import StoreUnavailable

    if config.database_url is None and not embedded_exists(config.data_dir):
        # never created here: a purge of nothing is an error, not a fresh cluster
        print(f"{PROG}: DATABASE_URL is not set and there is no embedded database under "
              f"{config.data_dir}; nothing was erased", file=sys.stderr)
        return 1
    try:
        erased = asyncio.run(_purge(config, tenant, args.batch_size))
    except DatabaseUnreachable as exc:
        print(f"{PROG}: {_unreachable(exc, config)}; nothing was erased", file=sys.stderr)
        return 1
    except _NotMigrated as exc:
        print(f"{PROG}: {exc}; nothing was erased", file=sys.stderr)
        return 1
    except StoreUnavailable as exc:  # a conflict with another writer included
        print(f"{PROG}: the database failed during the purge ({exc}); what was erased "
              "before is recorded, run purge-tenant again to finish", file=sys.stderr)
        return 1
    except (asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        # refused by the database: a role without the privilege to delete, say
        print(f"{PROG}: the database refused the purge ({described(exc)}); what was erased "
              "before is recorded, run purge-tenant again once it is allowed", file=sys.stderr)
        return 1
    document = {"tenant_id": tenant, "sessions": erased.sessions, "plans": erased.plans,
                "events": erased.events, "compactions": erased.compactions,
                "idempotency_keys": erased.idempotency_keys, "usage_rows": erased.usage_rows,
                "calibrations": erased.calibrations,
                "erased_at": erased.erased_at.isoformat(), "recorded": erased.deleted}
    if args.json:
        return _emit(json.dumps(document, sort_keys=True))
    lines = [f"tenant {tenant}: " + ("erased" if erased.deleted else "nothing to erase")]
    lines += [f"  {kind:<17} {document[kind]}" for kind in (
        "sessions", "plans", "events", "compactions", "idempotency_keys", "usage_rows",
        "calibrations")]
    if erased.deleted:
        lines.append(f"recorded in erasures (scope tenant) at {document['erased_at']}; "
                     "the tenant's API tokens are kept")
    return _emit("\n".join(lines))


class _NotMigrated(Exception):
    """A purge of a database without the service's tables: nothing was erased."""


async def _purge(config: Config, tenant: str, batch_size: int) -> Erased:
    from context_engine.adapters.postgres.erasure import PostgresErasure
    from context_engine.adapters.postgres.migrate import connecting
    from context_engine.adapters.postgres.pool import create_pool
    from context_engine.clock import SYSTEM_CLOCK

    url = await _database_url(config)
    async with connecting():  # a refusal or no answer: DatabaseUnreachable, as for migrate
        pool = await create_pool(url, pooler=config.db_pooler, max_size=1,
                                 timeout=config.db_timeout_seconds)
    try:
        async with pool.acquire() as conn:
            migrated = await conn.fetchval("SELECT to_regclass('sessions') IS NOT NULL")
        if not migrated:
            raise _NotMigrated(f"the database is not migrated: run `{PROG} migrate` first")
        return await PostgresErasure(pool, command_timeout=config.db_timeout_seconds
                                     ).purge_tenant(tenant, requested_by=PURGE_REQUESTED_BY,
                                                    now=SYSTEM_CLOCK.now,
                                                    batch_size=batch_size)
    finally:
        await pool.close()


# ---------------------------------------------------------------------------- migrate


async def _database_url(config: Config) -> str:
    if config.database_url is not None:
        return config.database_url
    from context_engine.api.server import embedded_database_url

    return await asyncio.to_thread(embedded_database_url, config.data_dir)


async def _migrate(config: Config) -> int:
    from context_engine.adapters.postgres.migrate import migrate
    from context_engine.telemetry.logs import log

    applied = await migrate(await _database_url(config), config.migrations_dir,
                            connect_timeout=config.db_timeout_seconds)
    log("migrated", applied=applied)
    return 0


async def _migration_status(config: Config) -> int:
    from context_engine.adapters.postgres.migrate import (
        BROKEN,
        MigrationFailed,
        discover,
        reconcile,
        status,
    )
    from context_engine.api.server import embedded_exists

    if config.database_url is None and not embedded_exists(config.data_dir):
        # No embedded database yet (and --status creates none): every migration is pending.
        entries = reconcile([], discover(config.migrations_dir))
    else:
        try:
            entries = await status(await _database_url(config), config.migrations_dir,
                                   connect_timeout=config.db_timeout_seconds)
        except MigrationFailed as exc:
            print(f"{PROG}: {_migration_failed(exc, config, reading=True)}", file=sys.stderr)
            return 1
    print(format_status(entries))
    return 1 if any(e.check in BROKEN for e in entries) else 0


def format_status(entries: Sequence[Entry]) -> str:
    """The table of ``migrate --status``, a summary line, and each mismatch in full."""
    from context_engine.adapters.postgres.migrate import Check

    rows = [("version", "name", "state", "applied_at", "checksum")]
    notes: list[str] = []
    for e in entries:
        if e.pending:
            rows.append((f"{e.version:04d}", e.name, "pending", "-", "-"))
            continue
        assert e.applied_at is not None and e.check is not None
        rows.append((f"{e.version:04d}", e.name, "applied",
                     e.applied_at.isoformat(timespec="seconds"), e.check.value))
        if e.check is Check.CHANGED:
            notes.append(f"{e.label}.sql changed: recorded sha256 {e.recorded}, "
                         f"file {e.current}")
        elif e.check is Check.RENAMED:
            notes.append(f"{e.label} was applied under that name; the file is now "
                         f"{e.file_name}")
        elif e.check is Check.MISSING:
            notes.append(f"{e.label} is applied but has no file, though later migrations do "
                         f"(a removed file)")
        elif e.check is Check.NEWER:
            notes.append(f"{e.label} is a newer release's (numbered past this release's "
                         f"migrations): this release runs on its schema")
        elif e.check is Check.UNRECORDED:
            notes.append(f"{e.label}: applied before checksums were kept; the next "
                         f"`migrate` or `serve` records the file's")
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(f"{cell:<{widths[i]}}" for i, cell in enumerate(r)).rstrip()
             for r in rows]
    applied = [e for e in entries if not e.pending]
    counts = {c: sum(1 for e in applied if e.check is c) for c in Check}
    summary = f"{len(applied)} applied, {len(entries) - len(applied)} pending"
    flagged = [f"{n} {c.value}" for c, n in counts.items() if n and c is not Check.OK]
    if flagged:
        summary += "; " + ", ".join(flagged)
    return "\n".join([*lines, "", summary, *notes])


if __name__ == "__main__":
    raise SystemExit(main())
