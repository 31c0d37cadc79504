"""Cache bench: the scripted session's cache economics per provider format under each provider's
fake cache, for the engine's assembly and for a naive one.

One scripted session (the fifty-turn session of the prefix-stability gate, see
``tests/support/runtime.py``) runs against the real server (the CLI's ``start``) on an ephemeral
loopback port with a throwaway embedded PostgreSQL. Every model step is a Build with the
Anthropic provider format and, from the same checkpoint (estimator factor pinned), one Build per
other format (``FanOutStub`` in ``tests/support/cache_sim.py``): OpenAI Responses, OpenAI Chat
Completions, Gemini generateContent and Bedrock Converse. Each format's bodies go, at the
session's clock, to a fresh fake of its provider (``tests/support/cache_sim.py``: Anthropic's
breakpoints and 20-block lookback; OpenAI's automatic prefix caching from 1,024 tokens in
128-token steps, routed by ``prompt_cache_key``; Gemini's implicit caching, and its explicit
cached content created from ``gemini_cached_content`` once and kept alive; Bedrock's
``cachePoint`` checkpoints). The same bodies are then replayed, at the same times, into fresh
fakes after a naive assembly, rendered into each format the same way:

* engine: the bodies as Build returned them (the date is in the runtime row, Region B);
* naive: the current date put at the start of the system prompt (Anthropic's first system
  block, the Responses ``instructions``, the Chat Completions system message, Gemini's
  ``systemInstruction`` — and so its cached content, which a runtime must create again when it
  changes — and Bedrock's first ``system`` block), as an assembly that treats the date as
  configuration would;
* naive, date and time: the same with the time to the minute (the common worse variant).

Gemini's explicit cache is run by a runtime that creates the cached content when there is none
for the create body's exact bytes (or it expired), sends ``cached_body_json`` with
``cachedContent`` and patches the content's TTL after each use (an explicit cached content's
expiry is fixed at creation: use does not extend it); one more row shows the engine's bodies by
a runtime that never patches it, so it lapses and is created again.

Printed per format and assembly: the cached prefix ratio (Region A tokens read from a cache an
earlier request wrote / Region A tokens, requests after the first), the cached share of all
input tokens after turn 1, the requests whose Region A was not read from cache as far as the
provider's granularity allows (OpenAI counts cached tokens in 128-token steps, so when the
conversation changes right after Region A — the first step's user message moving into the
history, a compaction — the last few tokens of Region A are not read: the ratio shows them, the
misses do not), and the
relative input cost: what the input cost against the same tokens sent uncached, at each
provider's published price ratios when this was written (re-check them): Anthropic and Bedrock
(Claude) cache writes 1.25x (five minutes), reads 0.1x; OpenAI (GPT-5 family) reads 0.1x, writes
free; Gemini (2.5 family) reads 0.1x, an explicit cached content's creation billed once at 1x
(its storage, per token-hour, is left out). Written as the "Cache bench" section of
``tests/bench/results.md`` (after what ``build_bench`` wrote; replaced on every run).

    .venv/bin/python -m tests.bench.cache_bench [--seed N] [--turns N] [--output PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # no fork() notices from pgserver's pg_ctl

from tests.bench.common import Deadline, deadline
from tests.support.cache_sim import (
    ANTHROPIC_MESSAGES,
    BEDROCK_CONVERSE,
    FORMATS,
    GEMINI_GENERATE_CONTENT,
    OPENAI_CHAT_COMPLETIONS,
    OPENAI_RESPONSES,
    BuiltBody,
    CacheUsage,
    FanOutStub,
    Transform,
    simulate,
    simulate_gemini_explicit,
)
from tests.support.runtime import (
    Clock,
    RequestRecord,
    Runtime,
    SessionScript,
    figures,
    local_server,
)

DEADLINE_SECONDS = 180
RESULTS = Path(__file__).resolve().parent / "results.md"
SECTION = "## Cache bench"
GEMINI_EXPLICIT = "gemini_generate_content, explicit cache"
# (write, read) cost of a token, of the same token sent uncached
COSTS = {ANTHROPIC_MESSAGES: (1.25, 0.1), BEDROCK_CONVERSE: (1.25, 0.1),
         OPENAI_RESPONSES: (1.0, 0.1), OPENAI_CHAT_COMPLETIONS: (1.0, 0.1),
         GEMINI_GENERATE_CONTENT: (1.0, 0.1), GEMINI_EXPLICIT: (1.0, 0.1)}
RULES = {
    ANTHROPIC_MESSAGES: "4 breakpoints, 20-block lookback, 5m/1h TTLs, 1,024-token minimum",
    OPENAI_RESPONSES: "automatic, from 1,024 tokens in 128-token steps, routed by "
                      "prompt_cache_key and the first 256 tokens, 5 idle minutes",
    OPENAI_CHAT_COMPLETIONS: "as Responses",
    GEMINI_GENERATE_CONTENT: "implicit: token-exact prefix match above the model's minimum "
                             "(1,024 here), 5 idle minutes (assumed)",
    GEMINI_EXPLICIT: "cachedContents created from create_body_json when its bytes change or it "
                     "expired, TTL patched after each use",
    BEDROCK_CONVERSE: "cachePoint checkpoints (at most 4), 1,024-token minimum per checkpoint, "
                      "5m TTL refreshed on hit, 20-block lookback",
}


def relative_cost(name: str, usages: list[CacheUsage]) -> float:
    write, read = COSTS[name]
    total = sum(u.total_input_tokens for u in usages)
    paid = sum(u.input_tokens + write * u.cache_creation_input_tokens
               + read * u.cache_read_input_tokens for u in usages)
    return paid / total if total else 0.0


# ------------------------------------------------------------------------------ naive bodies

def dated(text: str, stamp: str) -> str:
    return f"Today is {stamp}.\n\n{text}"


def naive_body(provider_format: str, body: dict[str, Any], stamp: str) -> dict[str, Any]:
    """The same body assembled naively: the date (``stamp``) at the start of the system
    prompt, wherever the format keeps it. A Gemini cached content's create body (it holds the
    ``systemInstruction``) is changed the same way."""
    out: dict[str, Any] = json.loads(json.dumps(body))
    if provider_format in (ANTHROPIC_MESSAGES, BEDROCK_CONVERSE):
        first = next(b for b in out["system"] if "text" in b)
        first["text"] = dated(first["text"], stamp)
    elif provider_format == OPENAI_RESPONSES:
        out["instructions"] = dated(out.get("instructions") or "", stamp)
    elif provider_format == OPENAI_CHAT_COMPLETIONS:
        system = out["messages"][0]
        assert system["role"] == "system", system
        system["content"] = dated(system["content"], stamp)
    elif provider_format == GEMINI_GENERATE_CONTENT:
        part = out["systemInstruction"]["parts"][0]
        part["text"] = dated(part["text"], stamp)
    else:
        raise ValueError(provider_format)
    return out


def stamp_of(b: BuiltBody, with_time: bool) -> str:
    at = b.at
    assert not isinstance(at, float | int)
    return at.strftime("%Y-%m-%d %H:%M") if with_time else at.date().isoformat()


def naive(provider_format: str, with_time: bool) -> Transform:
    def transform(b: BuiltBody, body: dict[str, Any]) -> dict[str, Any]:
        return naive_body(provider_format, body, stamp_of(b, with_time))
    return transform


# ------------------------------------------------------------------------------ the table

@dataclass(frozen=True)
class Row:
    provider: str  # a format name, or GEMINI_EXPLICIT
    assembly: str
    cached_prefix_ratio: float
    cached_share: float
    misses: int
    relative_cost: float
    note: str = ""


ASSEMBLIES = (("engine (date in Region B)", None), ("naive (date in system)", False),
              ("naive (date+time, minute)", True))
# Gemini's explicit cache with the engine's bodies, by a runtime that never patches the cached
# content's TTL: it expires (use does not extend it) and is created again when next needed.
LAPSED = "engine, TTL never patched"
COLUMNS = (("format", 40), ("assembly", 26), ("cached prefix ratio", 19),
           ("cached share after turn 1", 25), ("Region A misses", 15), ("relative cost", 13))


def make_row(provider: str, assembly: str, records: list[RequestRecord],
             usages: list[CacheUsage], note: str = "") -> Row:
    fig = figures(records, usages)
    misses = sum(u.prefix_read_tokens < u.prefix_cacheable_tokens for u in usages[1:])
    return Row(provider=provider, assembly=assembly, cached_prefix_ratio=fig.cached_prefix_ratio,
               cached_share=fig.cached_share, misses=misses,
               relative_cost=relative_cost(provider, usages), note=note)


def rows_of(records: list[RequestRecord], fan: FanOutStub) -> list[Row]:
    rows: list[Row] = []
    for name in FORMATS:
        built = fan.built[name]
        for assembly, with_time in ASSEMBLIES:
            if with_time is None and name == ANTHROPIC_MESSAGES:
                usages = [r.usage for r in records]  # what the runtime's own provider saw
            else:
                usages = simulate(name, built,
                                  transform=None if with_time is None else naive(name, with_time))
            rows.append(make_row(name, assembly, records, usages))
        if name == GEMINI_GENERATE_CONTENT:
            for assembly, with_time in (*ASSEMBLIES, (LAPSED, None)):
                transform = None if with_time is None else naive(name, with_time)
                run = simulate_gemini_explicit(built, transform_create=transform,
                                               transform_full=transform,
                                               keep_alive=assembly != LAPSED)
                rows.append(make_row(GEMINI_EXPLICIT, assembly, records, run.usages,
                                     note=f"{len(run.created)} cached contents created, "
                                          f"{run.fallbacks} requests sent whole"))
    return rows


def line(cells: list[str]) -> str:
    padded = [c.ljust(w) if i < 2 else c.rjust(w)
              for i, (c, (_, w)) in enumerate(zip(cells, COLUMNS, strict=True))]
    return "| " + " | ".join(padded) + " |"


def table(rows: list[Row]) -> str:
    out = [line([name for name, _ in COLUMNS]),
           "|" + "|".join(("-" * (w + 2)) if i < 2 else ("-" * (w + 1) + ":")
                          for i, (_, w) in enumerate(COLUMNS)) + "|"]
    for r in rows:
        out.append(line([r.provider, r.assembly, f"{r.cached_prefix_ratio:.4f}",
                         f"{r.cached_share:.4f}", str(r.misses), f"{r.relative_cost:.3f}"]))
    return "\n".join(out)


def section(header: str, rows: list[Row]) -> str:
    notes = [f"- {r.provider}, {r.assembly}: {r.note}" for r in rows if r.note]
    rules = [f"- {name}: {rule}" for name, rule in RULES.items()]
    return "\n".join([
        SECTION, "",
        "Produced by `make bench` (`.venv/bin/python -m tests.bench.cache_bench`); this section "
        "is replaced on every run.", "", header, "", table(rows), "",
        "Cached prefix ratio: Region A tokens read from a cache an earlier request wrote over "
        "Region A tokens, requests after the first. Region A misses: requests whose Region A "
        "was not read as far as the provider's granularity allows (OpenAI's 128-token steps "
        "leave up to 127 tokens of it unread when the conversation changes right after it; "
        "the ratio counts them, the misses do not). Relative cost: input paid over the same "
        "tokens uncached (writes 1.25x and reads 0.1x for Anthropic and Bedrock; reads 0.1x "
        "for OpenAI and Gemini; a Gemini cached content's creation 1x, storage left out).", "",
        "Each provider's fake (`tests/support/cache_sim.py`, where every rule names its "
        "source):", *rules, "", *notes, ""])


def write_section(path: Path, text: str) -> None:
    """Replace the cache bench's section of ``path`` (or add it at the end)."""
    old = path.read_text() if path.exists() else ""
    head = old.split(f"\n{SECTION}\n", 1)[0].rstrip("\n") if old else ""
    path.write_text((head + "\n\n" if head else "") + text)


# ------------------------------------------------------------------------------ the run

@contextmanager
def served(database_url: str | None) -> Iterator[Any]:
    """A stub of the real server: on a throwaway embedded PostgreSQL, or on ``database_url``
    (migrated already)."""
    if database_url is None:
        with local_server() as stub:
            yield stub
        return
    from tests.bench.build_bench import Server
    from tests.bench.common import Loop

    loop = Loop()
    server = None
    try:
        server = Server(loop, database_url)
        yield server.stub
    finally:
        if server is not None:
            server.close()
        loop.close()


@dataclass(frozen=True)
class Result:
    records: list[RequestRecord]
    fan: FanOutStub
    rows: list[Row]
    header: str
    elapsed: float


def measure(script: SessionScript, *, database_url: str | None = None,
            session: str = "") -> Result:
    started = time.monotonic()
    with served(database_url) as stub:
        booted = time.monotonic() - started
        clock = Clock(script.start)
        fan = FanOutStub(stub, clock)  # every step also built in every other format
        runtime = Runtime(fan, tenant="cache-bench", session=session or f"bench-{script.seed}",
                          script=script, clock=clock)
        out = runtime.run()
    records = out.records
    rows = rows_of(records, fan)
    elapsed = time.monotonic() - started
    days = sorted({r.date for r in records})
    sources = ", ".join(sorted({r.body_source for r in records}))
    header = (f"Scripted session: {script.turns} turns, {len(records)} model requests x "
              f"{len(FORMATS)} formats, seed {script.seed}; clock "
              f"{records[0].at:%Y-%m-%d %H:%M} -> {records[-1].at:%Y-%m-%d %H:%M} "
              f"({' -> '.join(days)}); Region A {records[0].usage.prefix_tokens:,} tokens "
              f"(Anthropic body, cl100k); provider bodies: {sources}. Server start "
              f"{booted:.1f} s, total {elapsed:.1f} s, loopback only.")
    return Result(records=records, fan=fan, rows=rows, header=header, elapsed=elapsed)


def run(script: SessionScript, output: Path | None = RESULTS, *,
        database_url: str | None = None, session: str = "",
        printer: Callable[[str], None] = print) -> Result:
    result = measure(script, database_url=database_url, session=session)
    printer(result.header + "\n")
    printer(table(result.rows))
    if output is not None:
        write_section(output, section(result.header, result.rows))
        printer(f"\nwritten to {output}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=SessionScript.seed)
    parser.add_argument("--turns", type=int, default=SessionScript.turns)
    parser.add_argument("--output", type=Path, default=RESULTS,
                        help="the results file whose cache bench section is replaced")
    args = parser.parse_args(argv)
    script = replace(SessionScript(), seed=args.seed, turns=args.turns)
    try:
        with deadline(DEADLINE_SECONDS, "the cache bench"):
            run(script, args.output)
        return 0
    except Deadline as exc:
        print(exc, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
