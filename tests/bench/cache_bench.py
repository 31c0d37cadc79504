"""Cache bench: the scripted session's cache figures under the fake provider,
for the engine's assembly and for a naive one.

One scripted session (the fifty-turn session of the prefix-stability gate, see
``tests/support/runtime.py``) runs against the real server (the CLI's ``start``) on an ephemeral
loopback port with a throwaway embedded PostgreSQL. Every model step is a Build with the
Anthropic provider format; the body goes to the fake Anthropic provider
(``tests/support/cache_sim.py``) at the session's clock. The same bodies are then replayed, at the
same times, into fresh simulators after a naive assembly:

* engine: the bodies as Build returned them (the date is in the runtime row, Region B);
* naive: the current date put in the system prompt (inserted at the start of the first system
  block of each body), as an assembly that treats the date as configuration would;
* naive, date and time: the same with the time to the minute (the common worse variant).

Printed per assembly: the cached prefix ratio (Region A tokens read from cache / Region A
tokens, requests after the first), the cached share of all input tokens after turn 1, the
requests whose Region A was not read from cache, and the relative input cost (cache writes at
1.25x, reads at 0.1x, of the same tokens sent uncached).

    .venv/bin/python -m tests.bench.cache_bench [--seed N] [--turns N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # no fork() notices from pgserver's pg_ctl

from tests.bench.common import Deadline, deadline
from tests.support.cache_sim import CacheUsage
from tests.support.runtime import (
    RequestRecord,
    Runtime,
    SessionScript,
    figures,
    local_server,
    naive_body,
    replay,
)

DEADLINE_SECONDS = 120
WRITE_COST = 1.25  # 5-minute cache writes, of base input
READ_COST = 0.1


def relative_cost(usages: list[CacheUsage]) -> float:
    total = sum(u.total_input_tokens for u in usages)
    paid = sum(u.input_tokens + WRITE_COST * u.cache_creation_input_tokens
               + READ_COST * u.cache_read_input_tokens for u in usages)
    return paid / total if total else 0.0


COLUMNS = (("assembly", 26), ("cached prefix ratio", 19), ("cached share after turn 1", 25),
           ("Region A misses", 15), ("relative cost", 13))


def line(cells: list[str]) -> str:
    padded = [c.ljust(w) if i == 0 else c.rjust(w)
              for i, (c, (_, w)) in enumerate(zip(cells, COLUMNS, strict=True))]
    return "| " + " | ".join(padded) + " |"


def table_head() -> str:
    return "\n".join([line([name for name, _ in COLUMNS]),
                      "|" + "|".join("-" * (w + 2) for _, w in COLUMNS) + "|"])


def row(name: str, records: list[RequestRecord], usages: list[CacheUsage]) -> str:
    fig = figures(records, usages)
    misses = sum(u.prefix_read_tokens < u.prefix_tokens for u in usages[1:])
    return line([name, f"{fig.cached_prefix_ratio:.4f}", f"{fig.cached_share:.4f}",
                 str(misses), f"{relative_cost(usages):.3f}"])


def run(script: SessionScript) -> int:
    started = time.monotonic()
    with local_server() as stub:
        booted = time.monotonic() - started
        runtime = Runtime(stub, tenant="cache-bench", session=f"bench-{script.seed}",
                          script=script)
        out = runtime.run()
    records = out.records
    elapsed = time.monotonic() - started

    def naive(with_time: bool) -> Callable[[RequestRecord], dict[str, Any]]:
        def transform(r: RequestRecord) -> dict[str, Any]:
            stamp = r.at.strftime("%Y-%m-%d %H:%M") if with_time else r.date
            return naive_body(r.body(), stamp)
        return transform

    engine = [r.usage for r in records]
    naive_date = replay(records, naive(False))
    naive_time = replay(records, naive(True))
    days = sorted({r.date for r in records})
    sources = ", ".join(sorted({r.body_source for r in records}))
    print(f"Scripted session: {script.turns} turns, {len(records)} model requests, seed "
          f"{script.seed}; clock {records[0].at:%Y-%m-%d %H:%M} -> {records[-1].at:%Y-%m-%d %H:%M}"
          f" ({' -> '.join(days)}); Region A {records[0].usage.prefix_tokens:,} tokens "
          f"(cl100k); provider bodies: {sources}.")
    print(f"Fake Anthropic provider: 4 breakpoints, 20-block lookback, 5m/1h TTLs, 1,024-token "
          f"minimum. Server start {booted:.1f} s, total {elapsed:.1f} s, loopback only.\n")
    print(table_head())
    print(row("engine (date in Region B)", records, engine))
    print(row("naive (date in system)", records, naive_date))
    print(row("naive (date+time, minute)", records, naive_time))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=SessionScript.seed)
    parser.add_argument("--turns", type=int, default=SessionScript.turns)
    args = parser.parse_args(argv)
    script = replace(SessionScript(), seed=args.seed, turns=args.turns)
    try:
        with deadline(DEADLINE_SECONDS, "the cache bench"):
            return run(script)
    except Deadline as exc:
        print(exc, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
