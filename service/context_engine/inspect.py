"""``context-engine inspect``: one session's epochs and recent context events, for operators.

It reads PostgreSQL directly and read-only (see ``adapters.postgres.inspect``), and prints what
the plans table and the event outbox hold: hashes, reasons, token counts, tool names, event
counts and ids. It never prints a pinned specification's text, nor any message content.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TextIO

from context_engine.config import Pooler

if TYPE_CHECKING:  # the CLI imports this module for its arguments; the driver loads on use
    from context_engine.adapters.postgres.inspect import (
        SessionRecord,
        StoredEpoch,
        StoredEvent,
    )
    from context_engine.adapters.postgres.migrate import DatabaseUnreachable
    from context_engine.config import Config

DEFAULT_EVENTS = 20
_PROG = "context-engine inspect"
_HASH = re.compile(r"[0-9a-f]{64}")
_MAX_TEXT = 40  # longest string value shown in an event summary
_MAX_SUMMARY = 240
# Fields that say most about an event come first in its summary; the rest follow by name.
_LEADING = ("reason", "fits", "class", "transition", "run_id", "depth", "steps", "tokens",
            "prefix_sha256", "prefix_tokens", "model_id")
# Left out of summaries: the epoch has its own column, and the epoch rows show the versions.
_OMITTED = frozenset({"epoch", "builder_version", "policy_version", "tokenizer"})


# ---------------------------------------------------------------------------- arguments


INT32_MAX = 2_147_483_647


def _non_negative(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{raw!r} is not an integer") from exc
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    if value > INT32_MAX:  # epochs are PostgreSQL integers; no session holds more events
        raise argparse.ArgumentTypeError(f"{value} is above {INT32_MAX}")
    return value


def _positive(raw: str) -> int:
    value = _non_negative(raw)
    if value == 0:
        raise argparse.ArgumentTypeError("epochs start at 1")
    return value


def _identifier(raw: str) -> str:
    if not raw:
        raise argparse.ArgumentTypeError("must not be empty")
    return raw


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``inspect`` subcommand's arguments (bad ones exit with code 2)."""
    parser.add_argument("--tenant", "--tenant-id", required=True, type=_identifier,
                        help="tenant id")
    parser.add_argument("--session", required=True, type=_identifier, help="session id")
    parser.add_argument("--events", type=_non_negative, default=DEFAULT_EVENTS, metavar="N",
                        help=f"show the last N context events (default {DEFAULT_EVENTS})")
    parser.add_argument("--epoch", type=_positive, metavar="E",
                        help="show only epoch E, in detail, with its events")
    parser.add_argument("--json", action="store_true", help="print one JSON document")


# ---------------------------------------------------------------------------- formatting


def _printable(text: str) -> str:
    # A stored id with a newline or escape sequence must not break the table or the terminal.
    return "".join(ch if ch.isprintable() else "?" for ch in text)


def format_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """Columns separated by two spaces and padded to their widest cell; numbers are right-
    aligned, everything else left-aligned; no trailing whitespace."""
    cells = [[_printable(str(c)) for c in row] for row in rows]
    for row in cells:
        if len(row) != len(headers):
            raise ValueError(f"row has {len(row)} cells for {len(headers)} columns")
    cells_by_column: list[Sequence[str]] = (list(zip(*cells, strict=True)) if cells
                                            else [() for _ in headers])
    widths = [max([len(h), *(len(c) for c in col)]) for h, col in zip(headers, cells_by_column,
                                                                      strict=True)]
    numeric = [any(c != "-" for c in col) and all(_is_number(c) for c in col)
               for col in cells_by_column]

    def line(row: Sequence[str]) -> str:
        parts = [c.rjust(w) if num else c.ljust(w)
                 for c, w, num in zip(row, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    return [line(list(headers)), *(line(row) for row in cells)]


def _is_number(cell: str) -> bool:
    return cell == "-" or re.fullmatch(r"-?\d+(\.\d+)?", cell) is not None


def format_time(moment: datetime) -> str:
    """UTC, to the millisecond, e.g. ``2026-11-29 10:04:05.123Z``."""
    utc = moment.astimezone(UTC)
    return utc.strftime("%Y-%m-%d %H:%M:%S.") + f"{utc.microsecond // 1000:03d}Z"


def _names(names: Sequence[str]) -> str:
    return ", ".join(names) if names else "-"


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int):
        return str(value)
    text = str(value)
    if _HASH.fullmatch(text):
        return text[:12] + "..."
    return text if len(text) <= _MAX_TEXT else text[:_MAX_TEXT - 3] + "..."


def _steps(steps: list[Any]) -> str:
    # Budget pressure steps: which yielded and how many units each (ids stay in --json).
    parts = []
    for step in steps:
        if isinstance(step, dict):
            parts.append(f"{_scalar(step.get('step', '?'))}({_scalar(step.get('units', '?'))})")
    return ",".join(parts)


def summarize(payload: dict[str, Any]) -> str:
    """A one-line digest of an event payload: scalars as ``key=value`` (hashes shortened,
    long strings cut), lists and objects as their sizes (``name[3]``), token changes as
    ``tokens=before->after``; the full payload is in ``--json``."""
    fields = {k: v for k, v in payload.items() if k not in _OMITTED}
    if "tokens_before" in fields and "tokens_after" in fields and "tokens" not in fields:
        fields["tokens"] = f"{_scalar(fields.pop('tokens_before'))}->" \
                           f"{_scalar(fields.pop('tokens_after'))}"
    keys = [k for k in _LEADING if k in fields]
    keys += sorted(k for k in fields if k not in _LEADING)
    parts: list[str] = []
    for key in keys:
        value = fields[key]
        if value is None or value == [] or value == {}:
            continue
        if key == "steps" and isinstance(value, list):
            parts.append(f"steps={_steps(value)}")
        elif isinstance(value, list):
            parts.append(f"{key}[{len(value)}]")
        elif isinstance(value, dict):
            parts.append(f"{key}{{{len(value)}}}")
        else:
            parts.append(f"{key}={_scalar(value)}")
    text = " ".join(parts)
    return text if len(text) <= _MAX_SUMMARY else text[:_MAX_SUMMARY - 3] + "..."


def _class_names(epochs: Sequence[StoredEpoch]) -> list[str]:
    names: list[str] = []
    for e in epochs:
        names += [c.class_name for c in e.classes if c.class_name not in names]
    return names


def _events_section(record: SessionRecord, title: str) -> list[str]:
    shown = len(record.events)
    lines = [f"{title} (last {shown} of {record.events_total})"]
    if not record.events:
        return [*lines, "(none)"]
    return [*lines, *format_table(
        ["ID", "CREATED (UTC)", "EPOCH", "TYPE", "SUMMARY"],
        [[e.id, format_time(e.created_at), "-" if e.epoch is None else e.epoch, e.type,
          summarize(e.payload)] for e in record.events])]


def _header(record: SessionRecord) -> list[str]:
    return [f"session {record.session_id}  tenant {record.tenant_id}",
            f"current epoch {record.current_epoch}  created {format_time(record.created_at)}"
            f"  updated {format_time(record.updated_at)}"]


def render_overview(record: SessionRecord) -> str:
    """Every epoch of the session, its prefix classes and tools, then its recent events."""
    epochs = record.epochs
    lines = [*_header(record), "", f"EPOCHS ({len(epochs)})"]
    lines += format_table(
        ["EPOCH", "REASON", "CREATED (UTC)", "PREFIX_SHA256", "TOKENS", "MODEL", "TOKENIZER"],
        [[e.epoch, e.reason, format_time(e.created_at), e.prefix_sha256, e.prefix_tokens,
          e.model_id, e.tokenizer] for e in epochs])
    classes = _class_names(epochs)
    lines += ["", "PREFIX TOKENS BY CLASS"]
    lines += format_table(
        ["EPOCH", *classes],
        [[e.epoch, *({c.class_name: c.tokens for c in e.classes}.get(n, "-") for n in classes)]
         for e in epochs])
    lines += ["", "TOOLS"]
    lines += format_table(
        ["EPOCH", "PINNED", "DEFERRED", "SKIPPED"],
        [[e.epoch, _names(e.tool_names), _names(e.deferred_tool_names),
          _names(e.skipped_tool_names)] for e in epochs])
    lines += ["", *_events_section(record, "EVENTS")]
    return "\n".join(lines) + "\n"


def render_epoch(record: SessionRecord, epoch: StoredEpoch) -> str:
    """One epoch in detail: every stored field but the specification text, then its events."""
    lines = [*_header(record), "", f"EPOCH {epoch.epoch}"
             + ("  (current)" if epoch.epoch == record.current_epoch else "")]
    fields: list[tuple[str, object]] = [
        ("reason", epoch.reason), ("created (UTC)", format_time(epoch.created_at)),
        ("prefix_sha256", epoch.prefix_sha256), ("prefix tokens", epoch.prefix_tokens),
        ("model", epoch.model_id), ("tokenizer", epoch.tokenizer),
        ("builder version", epoch.builder_version), ("policy version", epoch.policy_version),
        ("cache ttl", epoch.cache_ttl), ("scope hashes", len(epoch.authority_scope_hashes)),
        ("pinned tools", _names(epoch.tool_names)),
        ("deferred tools", _names(epoch.deferred_tool_names)),
        ("skipped tools", _names(epoch.skipped_tool_names))]
    width = max(len(k) for k, _ in fields)
    lines += [_printable(f"{k.ljust(width)}  {v}") for k, v in fields]
    lines += ["", "PREFIX CLASSES"]
    lines += format_table(["CLASS", "TOKENS", "CAP", "ITEMS", "ITEM_CAP"],
                          [[c.class_name, c.tokens, c.cap, c.items, c.item_cap]
                           for c in epoch.classes])
    lines += ["", *_events_section(record, f"EVENTS OF EPOCH {epoch.epoch}")]
    return "\n".join(lines) + "\n"


def _epoch_document(e: StoredEpoch) -> dict[str, Any]:
    return {"epoch": e.epoch, "reason": e.reason, "created_at": e.created_at.isoformat(),
            "prefix_sha256": e.prefix_sha256, "prefix_tokens": e.prefix_tokens,
            "classes": [{"class_name": c.class_name, "tokens": c.tokens, "cap": c.cap,
                         "items": c.items, "item_cap": c.item_cap} for c in e.classes],
            "model_id": e.model_id, "tokenizer": e.tokenizer,
            "tool_names": list(e.tool_names), "deferred_tool_names": list(e.deferred_tool_names),
            "skipped_tool_names": list(e.skipped_tool_names),
            "authority_scope_hashes": list(e.authority_scope_hashes),
            "builder_version": e.builder_version, "policy_version": e.policy_version,
            "cache_ttl": e.cache_ttl}


def _event_document(e: StoredEvent) -> dict[str, Any]:
    return {"id": e.id, "epoch": e.epoch, "type": e.type, "created_at": e.created_at.isoformat(),
            "summary": summarize(e.payload), "payload": e.payload}


def document(record: SessionRecord, *, epoch: int | None = None) -> dict[str, Any]:
    """The machine-readable form: the same rows, full lists, event payloads as stored."""
    return {"tenant_id": record.tenant_id, "session_id": record.session_id,
            "current_epoch": record.current_epoch,
            "created_at": record.created_at.isoformat(),
            "updated_at": record.updated_at.isoformat(), "epoch_filter": epoch,
            "epochs": [_epoch_document(e) for e in record.epochs],
            "events_total": record.events_total,
            "events": [_event_document(e) for e in record.events]}


# ---------------------------------------------------------------------------- running


async def inspect_session(database_url: str, tenant_id: str, session_id: str, *,
                          events: int = DEFAULT_EVENTS, epoch: int | None = None,
                          as_json: bool = False, out: TextIO | None = None,
                          err: TextIO | None = None, pooler: Pooler = Pooler.NONE,
                          timeout: float = 10.0,
                          unreachable: Callable[[DatabaseUnreachable], str] | None = None,
                          ) -> int:
    """Print the session to ``out``; 0 on success, 1 (with a message on ``err``) when the
    session or epoch is unknown or the database cannot be read. ``timeout``: of connecting
    and of each statement (``CE_DB_TIMEOUT_SECONDS``); ``unreachable``: why the connection
    failed, in words (the commands' own, which name the URL or the data directory)."""
    import asyncpg

    from context_engine.adapters.postgres.inspect import connect_read_only, read_session
    from context_engine.adapters.postgres.migrate import DatabaseUnreachable, connecting

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        async with connecting():  # the URL unusable, refused, or not answered in time
            conn = await connect_read_only(database_url, pooler=pooler, timeout=timeout)
    except DatabaseUnreachable as exc:
        why = unreachable(exc) if unreachable is not None else (
            f"cannot connect to the database ({exc})")
        print(f"{_PROG}: {why}", file=err)
        return 1
    try:
        record = await read_session(conn, tenant_id, session_id, events=events, epoch=epoch,
                                    timeout=timeout)
    except asyncpg.UndefinedTableError:
        print(f"{_PROG}: the database has no context-engine tables; run "
              "`context-engine migrate` first", file=err)
        return 1
    except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        print(f"{_PROG}: reading the session failed ({type(exc).__name__})", file=err)
        return 1
    finally:
        await conn.close()
    if record is None:
        print(f"{_PROG}: no session {session_id!r} for tenant {tenant_id!r}", file=err)
        return 1
    if epoch is not None and not record.epochs:
        print(f"{_PROG}: session {session_id!r} of tenant {tenant_id!r} has no epoch {epoch} "
              f"(current epoch {record.current_epoch})", file=err)
        return 1
    if as_json:
        out.write(json.dumps(document(record, epoch=epoch), indent=2, sort_keys=True) + "\n")
    elif epoch is not None:
        out.write(render_epoch(record, record.epochs[0]))
    else:
        out.write(render_overview(record))
    return 0


def run(config: Config, args: argparse.Namespace) -> int:
    """The CLI entry: ``DATABASE_URL``, or the embedded database under the data directory
    (never created here: an inspection of nothing is an error, not a fresh cluster)."""
    from context_engine.domain.identifiers import erasable_identifier_problem

    for flag, value in (("--tenant", args.tenant), ("--session", args.session)):
        # the rule erasure takes: a session stored under an id an earlier release accepted
        # can still be read; one no request can carry (bytes that are no UTF-8) is no id
        problem = erasable_identifier_problem(value)
        if problem is not None:
            print(f"{_PROG}: {flag} {problem}", file=sys.stderr)
            return 2
    url = config.database_url
    if url is None:
        from context_engine.api.server import embedded_database_url, embedded_exists

        if not embedded_exists(config.data_dir):
            print(f"{_PROG}: DATABASE_URL is not set and there is no embedded database under "
                  f"{config.data_dir}", file=sys.stderr)
            return 1
        url = embedded_database_url(config.data_dir)
    from context_engine.cli import _unreachable

    return asyncio.run(inspect_session(url, args.tenant, args.session, events=args.events,
                                       epoch=args.epoch, as_json=args.json,
                                       pooler=config.db_pooler,
                                       timeout=config.db_timeout_seconds,
                                       unreachable=lambda exc: _unreachable(exc, config)))
