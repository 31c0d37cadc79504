"""Where a warm Build's server-side time goes, on the wall clock: when each phase of the servicer's
Build begins and ends (medians, ms from the moment the servicer's ``Build`` is entered), for a
whole warm Build and an incremental one (two items appended to a held base), at the benchmark's
sizes.

``make bench --profile`` (cProfile) names every function but inflates the small ones it calls
many times; this wraps only the phases below, a clock read at each end, so the figures are the
ones the served path takes. Phases overlap where the Build waits: the plan is read while the
checkpoint is mapped and scanned; the pressure event (``Engine._record``) is written once the
response is made. Not part of
``make bench``: ``.venv/bin/python -m tests.bench.timeline [--sizes 200,3000] [--rounds 40]``.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from context_engine import build_cache, engine
from context_engine.adapters.postgres import store
from context_engine.api import incremental, mapping, servicer
from context_engine.domain import builder

from tests.bench.build_bench import (
    CASES,
    Case,
    Database,
    IncrementalTurn,
    Server,
    build_request,
    plan_request,
    timed_build,
)
from tests.bench.common import Loop, deadline
from tests.bench.conversations import generate

ORIGIN = "servicer Build (the call)"
# (label, where the name is looked up when it is called, the name), in the Build's order
PHASES: tuple[tuple[str, Any, str], ...] = (
    (ORIGIN, servicer.ContextEngineServicer, "Build"),
    ("proto -> domain (mapping.checkpoint)", mapping, "checkpoint"),
    ("validation (checkpoint_scan)", servicer, "checkpoint_scan"),
    ("Engine.build (plan lookup awaited, build, event, response)", engine.Engine, "build"),
    ("  items normalized (builder.normalized)", builder, "normalized"),
    ("  history units (builder.units_of)", builder, "units_of"),
    ("  allocation (budget.allocate)", builder, "allocate"),
    ("  pressure event written (Engine._record)", engine.Engine, "_record"),
    ("    its JSON (store.event_json)", store, "event_json"),
    ("  assembly (builder.finish)", engine, "finish"),
    ("    row order (builder.rows_around)", builder, "rows_around"),
    ("    kept history's messages (builder.history_messages)", builder, "history_messages"),
    ("    pairing validator (builder.assert_paired_since)", builder, "assert_paired_since"),
    ("  response relative to the base (incremental.respond)", incremental, "respond"),
    ("    message spans (incremental.message_spans)", incremental, "message_spans"),
    ("    domain -> proto (mapping.build_pb)", mapping, "build_pb"),
    ("base kept (BuildCache.put)", build_cache.BuildCache, "put"),
)


@dataclass
class Calls:
    """One Build's phases: the first begin, the last end and the summed time of each (s)."""
    begin: dict[str, float] = field(default_factory=dict)
    end: dict[str, float] = field(default_factory=dict)
    took: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))

    def clear(self) -> None:
        self.begin.clear()
        self.end.clear()
        self.took.clear()

    def enter(self, label: str) -> float:
        now = time.perf_counter()
        self.begin.setdefault(label, now)
        return now

    def leave(self, label: str, since: float) -> None:
        now = time.perf_counter()
        self.end[label] = now
        self.took[label] += now - since


def _timed(calls: Calls, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            since = calls.enter(label)
            try:
                return await fn(*args, **kwargs)
            finally:
                calls.leave(label, since)
        return timed_async

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        since = calls.enter(label)
        try:
            return fn(*args, **kwargs)
        finally:
            calls.leave(label, since)
    return timed


def original(owner: Any, name: str) -> Any:
    """What ``owner.name`` holds: a class's own attribute as stored (a method, not bound)."""
    return owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)


@contextmanager
def instrumented(calls: Calls) -> Iterator[None]:
    """Every phase wrapped while the block runs (servers started inside it are wrapped: the
    servicer's methods are bound when it is registered), restored after it. A phase whose name
    is gone raises AttributeError here, not a silent gap in the table."""
    originals = [(owner, name, original(owner, name)) for _, owner, name in PHASES]
    try:
        for (label, owner, name), (_, _, fn) in zip(PHASES, originals, strict=True):
            setattr(owner, name, _timed(calls, label, fn))
        yield
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)


@dataclass
class Timeline:
    """Per phase, the samples of its begin and end (ms after the origin) and of its time."""
    case: str
    kind: str
    client_ms: list[float] = field(default_factory=list)
    begins: defaultdict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    ends: defaultdict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    took: defaultdict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def add(self, calls: Calls, client_ms: float) -> None:
        origin = calls.begin[ORIGIN]
        self.client_ms.append(client_ms)
        for label in calls.begin:
            self.begins[label].append((calls.begin[label] - origin) * 1000)
            self.ends[label].append((calls.end[label] - origin) * 1000)
            self.took[label].append(calls.took[label] * 1000)

    def table(self) -> str:
        rounds = len(self.client_ms)
        lines = [f"#### {self.case}, {self.kind}: client-observed "
                 f"{statistics.median(self.client_ms):.2f} ms (median of {rounds})", "",
                 "| phase | begins ms | ends ms | takes ms | in Builds |",
                 "|---|---:|---:|---:|---:|"]
        for label, _, _ in PHASES:
            if label not in self.took:
                lines.append(f"| {label} | | | not called | 0 |")
                continue
            lines.append(f"| {label} | {statistics.median(self.begins[label]):.3f} | "
                         f"{statistics.median(self.ends[label]):.3f} | "
                         f"{statistics.median(self.took[label]):.3f} | "
                         f"{len(self.took[label])} |")
        return "\n".join(lines)


def run(cases: tuple[Case, ...], *, rounds: int, database_url: str | None = None
        ) -> list[Timeline]:
    """A whole warm Build and an incremental one per round (each on a new base, built first
    and not timed: the previous turn), per case; without ``database_url``, a throwaway
    embedded PostgreSQL."""
    calls = Calls()
    db = Database() if database_url is None else None
    url = db.url if db is not None else str(database_url)
    loop = Loop()
    out: list[Timeline] = []
    try:
        with instrumented(calls):
            server = Server(loop, url)
            try:
                for case in cases:
                    server.stub.Plan(plan_request(case), timeout=30)
                    request = build_request(case.session, generate(case.items))
                    turn = IncrementalTurn(request, f"{case.name}: ")
                    for _ in range(3):  # every cache warm, the appended items rendered
                        timed_build(server, request)
                        turn.round(server)
                    whole = Timeline(case.name, "whole warm Build")
                    inc = Timeline(case.name, "incremental warm Build (two items appended)")
                    for _ in range(rounds):
                        calls.clear()
                        ms, _ = timed_build(server, request)
                        whole.add(calls, ms)
                        turn.new_base(server)
                        calls.clear()
                        ms, _ = turn.send(server)
                        inc.add(calls, ms)
                    out += [whole, inc]
            finally:
                server.close()
    finally:
        loop.close()
        if db is not None:
            db.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="200,3000",
                        help=f"item counts, among {', '.join(str(c.items) for c in CASES)}")
    parser.add_argument("--rounds", type=int, default=40, help="Builds of each kind per size")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.sizes.split(",") if n.strip()]
    cases = tuple(c for c in CASES if c.items in sizes)
    if len(cases) != len(sizes):
        parser.error(f"--sizes: choose among {', '.join(str(c.items) for c in CASES)}")
    with deadline(600, "the timeline"):
        timelines = run(cases, rounds=args.rounds)
    print("\n\n".join(t.table() for t in timelines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
