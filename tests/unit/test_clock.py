"""Nothing in the service reads the wall clock but ``context_engine.clock`` (and the log line
timestamps): a static check over every module's syntax tree, so a date cannot slip into a
request behind the injectable clock's back. The fifty-turn gate then runs a real server on
the session's clock across New Year's midnight (tests/e2e/test_gate_prefix_stability.py)."""

from __future__ import annotations

import ast
from datetime import UTC, datetime
from pathlib import Path

from context_engine.clock import SYSTEM_CLOCK, time_ns

SERVICE = Path(__file__).resolve().parents[2] / "service" / "context_engine"
ALLOWED = {"clock.py", "telemetry/logs.py"}  # the clock itself; a log line's own timestamp
WALL = {("time", "time"), ("time", "time_ns"), ("time", "localtime"), ("time", "gmtime"),
        ("time", "ctime"), ("time", "asctime"), ("time", "strftime"), ("datetime", "now"),
        ("datetime", "utcnow"), ("datetime", "today"), ("date", "today"),
        ("datetime", "fromtimestamp"), ("date", "fromtimestamp")}
WALL_NAMES = {"time", "time_ns", "localtime", "gmtime", "ctime", "asctime", "strftime"}


def wall_clock_reads(source: str) -> list[str]:
    tree = ast.parse(source)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("time", "datetime"):
            found += [f"from {node.module} import {a.name}" for a in node.names
                      if a.name in WALL_NAMES]
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value
        name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
        if (name, node.func.attr) in WALL:
            found.append(f"line {node.lineno}: {name}.{node.func.attr}()")
    return found


def test_only_the_clock_reads_the_wall_clock() -> None:
    offenders = {}
    for path in sorted(SERVICE.rglob("*.py")):
        rel = path.relative_to(SERVICE).as_posix()
        if rel in ALLOWED or rel.startswith("v1/"):
            continue
        reads = wall_clock_reads(path.read_text(encoding="utf-8"))
        if reads:
            offenders[rel] = reads
    assert not offenders, offenders


def test_the_check_sees_the_usual_spellings() -> None:
    for source in ("import time\ntime.time()", "import datetime\ndatetime.datetime.now()",
                   "from datetime import datetime\ndatetime.now(UTC)",
                   "from datetime import date\ndate.today()", "from time import time_ns",
                   "import time\ntime.strftime('%Y')"):
        assert wall_clock_reads(source), source
    assert not wall_clock_reads("import time\ntime.monotonic()\ntime.perf_counter()")


def test_the_system_clock_is_utc_wall_time() -> None:
    before = datetime.now(UTC)
    now = SYSTEM_CLOCK.now()
    assert now.tzinfo is not None and now.utcoffset() is not None
    assert abs((now - before).total_seconds()) < 5
    assert abs(time_ns(SYSTEM_CLOCK) / 1e9 - now.timestamp()) < 5
