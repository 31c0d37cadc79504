"""Seeded agent conversations for the benchmark.

A conversation is a list of turns; every turn is one run: a user message, tool steps (an
assistant tool-call item with one call or several parallel calls, then one result item per
call, JSON or HTML of 200-8,000 characters) and, except in the last turn, a closing assistant
message. The last turn is the active run, stopped in the middle of its agent loop: it ends with
the result of its latest tool step, which the model has not answered yet. That step is a single
call, so the conversation without its last two items is the same run one step earlier (the base
of the benchmark's incremental Build, whose two appended items are that call and its result).

Pure and deterministic: the same size gives the same items (a seeded ``random.Random``, no
clock, no hashing of Python objects). Nothing here imports the service or langchain, so the
smoke test stays fast; ``to_proto`` and ``to_langchain`` import what they convert to.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

SIZES = (50, 200, 1_000)
# About this many tokens (cl100k_base) of content per size; the smoke test holds them to ±20%.
TARGET_TOKENS = {50: 40_000, 200: 150_000, 1_000: 700_000}
SEED = 20_261_129
RESULT_MIN_CHARS = 200
RESULT_MAX_CHARS = 8_000
SYSTEM_PROMPT = ("You are a research agent. Use the tools to gather facts, cite every source "
                 "by its URL or record id, and answer concisely.")

# (name, result format, trust of its results)
TOOLS = (
    ("web.fetch", "html", "external"),
    ("web.search", "json", "external"),
    ("crm.query", "json", "user"),
    ("files.read", "json", "user"),
    ("docs.open", "html", "external"),
)
TOOL_SPECS = {
    "web.fetch": ("Fetch a web page. Returns its HTML.", {"url": {"type": "string"}}, ["url"]),
    "web.search": ("Search the web. Returns ranked JSON hits.",
                   {"query": {"type": "string"}, "limit": {"type": "integer"}}, ["query"]),
    "crm.query": ("Query the CRM. Returns JSON records.",
                  {"filter": {"type": "string"}, "fields": {"type": "array"}}, ["filter"]),
    "files.read": ("Read a workspace file. Returns JSON metadata and content.",
                   {"path": {"type": "string"}}, ["path"]),
    "docs.open": ("Open an internal document. Returns its HTML.",
                  {"doc_id": {"type": "string"}}, ["doc_id"]),
}

_WORDS = (
    "account", "action", "agent", "analysis", "answer", "api", "approval", "archive", "audit",
    "balance", "batch", "billing", "branch", "budget", "build", "cache", "call", "campaign",
    "capacity", "case", "change", "channel", "check", "client", "cluster", "code", "column",
    "comment", "commit", "config", "contract", "cost", "count", "customer", "cycle", "data",
    "database", "deadline", "delivery", "deploy", "design", "detail", "device", "discount",
    "document", "domain", "draft", "email", "endpoint", "error", "estimate", "event", "export",
    "feature", "field", "file", "filter", "forecast", "format", "gateway", "graph", "group",
    "header", "incident", "index", "input", "invoice", "issue", "item", "job", "key", "label",
    "latency", "ledger", "limit", "line", "list", "log", "market", "memory", "merge", "message",
    "metric", "migration", "model", "module", "monitor", "network", "node", "note", "number",
    "offer", "order", "output", "owner", "package", "page", "partner", "patch", "payment",
    "pipeline", "plan", "policy", "pool", "price", "priority", "process", "product", "profile",
    "project", "query", "queue", "quota", "rate", "record", "region", "release", "report",
    "request", "resource", "response", "result", "review", "revenue", "risk", "role", "rule",
    "schedule", "schema", "score", "segment", "server", "service", "session", "setting",
    "shipment", "signal", "source", "stage", "status", "step", "storage", "stream", "subscription",
    "summary", "supplier", "support", "system", "table", "target", "task", "team", "template",
    "tenant", "test", "thread", "ticket", "timeline", "token", "topic", "total", "trace",
    "traffic", "transfer", "trend", "update", "usage", "user", "value", "vendor", "version",
    "volume", "warehouse", "window", "workflow", "zone", "quarterly", "regional", "pending",
    "verified", "delayed", "overdue", "renewed", "escalated", "archived", "active", "inactive",
    "critical", "minor", "major", "north", "south", "east", "west", "central", "enterprise",
    "premium", "standard", "trial", "annual", "monthly", "weekly", "daily", "internal"
)
_NAMES = ["Alvarez", "Bauer", "Chen", "Dubois", "Eriksen", "Fujita", "Garcia", "Haddad",
          "Ivanova", "Jensen", "Kowalski", "Larsen", "Moreau", "Nakamura", "Okafor", "Patel",
          "Quinn", "Rossi", "Schmidt", "Tanaka", "Umar", "Vargas", "Weber", "Yilmaz", "Zhang"]
_DOMAINS = ["example.com", "example.org", "docs.example.net", "status.example.io",
            "news.example.com", "wiki.example.org"]


@dataclass(frozen=True, slots=True)
class Call:
    call_id: str
    name: str
    arguments_json: str


@dataclass(frozen=True, slots=True)
class Item:
    """One checkpoint item. ``kind`` is user, assistant, tool_calls or tool_result."""

    id: str
    sequence: int
    run_id: str
    kind: str
    text: str = ""
    calls: tuple[Call, ...] = ()
    call_id: str = ""
    tool_name: str = ""
    trust: str = "user"  # user or external

    def texts(self) -> Iterator[str]:
        """The content a tokenizer sees: message text, call names and arguments, results."""
        if self.text:
            yield self.text
        for c in self.calls:
            yield c.name
            yield c.arguments_json


@dataclass(frozen=True, slots=True)
class Conversation:
    size: int
    seed: int
    items: tuple[Item, ...]
    active_run_id: str
    system: str = SYSTEM_PROMPT
    runs: int = 0
    parallel_steps: int = 0
    tool_results: int = 0
    result_chars: tuple[int, ...] = field(default=(), repr=False)

    def texts(self) -> Iterator[str]:
        for item in self.items:
            yield from item.texts()


# ---------------------------------------------------------------- content

def _sentence(rng: random.Random, lo: int = 6, hi: int = 18) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(lo, hi))]
    if rng.random() < 0.4:
        words.insert(rng.randrange(len(words)), str(rng.randint(2, 99_999)))
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), rng.choice(_NAMES))
    return " ".join(words).capitalize() + rng.choice(".....?!")


def _prose(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        s = _sentence(rng)
        out.append(s)
        size += len(s) + 1
    return " ".join(out)


def _record(rng: random.Random, n: int) -> dict[str, Any]:
    return {
        "id": f"rec-{rng.randint(10_000, 99_999)}-{n}",
        "name": f"{rng.choice(_NAMES)} {rng.choice(_WORDS).title()}",
        "status": rng.choice(["open", "closed", "pending", "escalated", "resolved"]),
        "amount": round(rng.uniform(10, 250_000), 2),
        "currency": rng.choice(["EUR", "USD", "GBP", "JPY"]),
        "updated_at": f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T"
                      f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:00Z",
        "tags": [rng.choice(_WORDS) for _ in range(rng.randint(1, 4))],
        "owner": {"email": f"{rng.choice(_NAMES).lower()}@{rng.choice(_DOMAINS)}",
                  "team": rng.choice(_WORDS)},
        "note": _sentence(rng, 4, 16),
    }


def _json_result(rng: random.Random, target: int) -> str:
    """A JSON document of at most ``target`` characters (and at least RESULT_MIN_CHARS)."""
    doc: dict[str, Any] = {"ok": True, "request_id": f"req-{rng.randint(0, 16**8):08x}",
                           "took_ms": rng.randint(3, 900), "results": []}
    text = json.dumps(doc, indent=1)
    n = 0
    while True:
        doc["results"].append(_record(rng, n))
        candidate = json.dumps(doc, indent=1)
        if len(candidate) > target:
            doc["results"].pop()
            break
        text = candidate
        n += 1
    doc["total"] = n + rng.randint(0, 40)
    text = json.dumps(doc, indent=1)
    if len(text) < RESULT_MIN_CHARS:
        doc["message"] = _prose(rng, RESULT_MIN_CHARS - len(text))
        text = json.dumps(doc, indent=1)
    return text if len(text) <= RESULT_MAX_CHARS else text[:RESULT_MAX_CHARS]


def _html_block(rng: random.Random) -> str:
    pick = rng.random()
    if pick < 0.35:
        return f"<p>{_prose(rng, rng.randint(80, 400))}</p>"
    if pick < 0.55:
        return f"<h2 id=\"s{rng.randint(1, 999)}\">{_sentence(rng, 2, 6)}</h2>"
    if pick < 0.75:
        lis = "".join(f"<li><a href=\"https://{rng.choice(_DOMAINS)}/{rng.choice(_WORDS)}/"
                      f"{rng.randint(1, 9999)}\">{_sentence(rng, 2, 7)}</a></li>"
                      for _ in range(rng.randint(2, 6)))
        return f"<ul class=\"links\">{lis}</ul>"
    rows = "".join(f"<tr><td>{rng.choice(_NAMES)}</td><td>{rng.choice(_WORDS)}</td>"
                   f"<td>{rng.randint(1, 99_999)}</td></tr>" for _ in range(rng.randint(2, 8)))
    return f"<table><tr><th>name</th><th>kind</th><th>value</th></tr>{rows}</table>"


def _html_result(rng: random.Random, target: int) -> str:
    head = (f"<!doctype html><html><head><title>{_sentence(rng, 2, 6)}</title>"
            f"<meta name=\"description\" content=\"{_sentence(rng, 4, 10)}\"></head><body>")
    tail = "</body></html>"
    blocks: list[str] = []
    size = len(head) + len(tail)
    while True:
        block = _html_block(rng)
        if size + len(block) > target:
            break
        blocks.append(block)
        size += len(block)
    text = head + "".join(blocks) + tail
    while len(text) < RESULT_MIN_CHARS:
        text = head + "".join(blocks) + f"<p>{_prose(rng, RESULT_MIN_CHARS)}</p>" + tail
    return text if len(text) <= RESULT_MAX_CHARS else text[:RESULT_MAX_CHARS - len(tail)] + tail


def _result_chars(rng: random.Random) -> int:
    """Skewed to the large end, as fetched pages and query results are."""
    return min(RESULT_MAX_CHARS, max(RESULT_MIN_CHARS,
                                     int(RESULT_MIN_CHARS + rng.betavariate(2.0, 1.0)
                                         * (RESULT_MAX_CHARS - RESULT_MIN_CHARS))))


def _arguments(rng: random.Random, name: str) -> str:
    if name == "web.fetch":
        args: dict[str, Any] = {"url": f"https://{rng.choice(_DOMAINS)}/{rng.choice(_WORDS)}/"
                                       f"{rng.randint(1, 99_999)}"}
    elif name == "web.search":
        args = {"query": _sentence(rng, 3, 8).rstrip(".?!").lower(), "limit": rng.choice([5, 10])}
    elif name == "crm.query":
        args = {"filter": f"status = '{rng.choice(['open', 'pending'])}' AND region = "
                          f"'{rng.choice(['north', 'south', 'east', 'west'])}'",
                "fields": rng.sample(["id", "name", "amount", "owner", "updated_at"], 3)}
    elif name == "files.read":
        args = {"path": f"reports/{rng.choice(_WORDS)}/{rng.choice(_WORDS)}-"
                        f"{rng.randint(1, 99)}.json"}
    else:
        args = {"doc_id": f"doc-{rng.randint(1000, 9999)}"}
    return json.dumps(args, separators=(",", ":"))


# ---------------------------------------------------------------- structure

class _Builder:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.items: list[Item] = []
        self.run = 0
        self.parallel_steps = 0
        self.result_chars: list[int] = []

    def _add(self, kind: str, **fields: Any) -> None:
        seq = len(self.items) + 1
        self.items.append(Item(id=f"i{seq:05d}", sequence=seq, run_id=f"run-{self.run}",
                               kind=kind, **fields))

    def user(self) -> None:
        self._add("user", text=_prose(self.rng, self.rng.randint(60, 700)), trust="user")

    def assistant(self) -> None:
        self._add("assistant", text=_prose(self.rng, self.rng.randint(150, 1_600)),
                  trust="user")

    def step(self, calls: int) -> None:
        rng = self.rng
        chosen = [rng.choice(TOOLS) for _ in range(calls)]
        batch = tuple(Call(call_id=f"call-{self.run}-{len(self.items) + 1}-{j}", name=t[0],
                           arguments_json=_arguments(rng, t[0]))
                      for j, t in enumerate(chosen))
        if calls > 1:
            self.parallel_steps += 1
        self._add("tool_calls", calls=batch, trust="user")
        for call, (name, fmt, trust) in zip(batch, chosen, strict=True):
            target = _result_chars(rng)
            content = _html_result(rng, target) if fmt == "html" else _json_result(rng, target)
            self.result_chars.append(len(content))
            self._add("tool_result", text=content, call_id=call.call_id, tool_name=name,
                      trust=trust)

    def calls(self) -> int:
        """One call most of the time; parallel steps of two or three calls otherwise."""
        r = self.rng.random()
        return 1 if r < 0.7 else (2 if r < 0.9 else 3)

    def turn(self, room: int) -> None:
        """A completed turn (run) of at most ``room`` items: user, steps, assistant."""
        self.run += 1
        self.user()
        left = room - 2  # the closing assistant message
        for _ in range(self.rng.randint(1, 4)):
            k = self.calls()
            if k + 1 > left:
                break
            self.step(k)
            left -= k + 1
            if left >= 1 and self.rng.random() < 0.15:  # the model thinks aloud mid-loop
                self.assistant()
                left -= 1
        self.assistant()

    def final_turn(self, exactly: int) -> None:
        """The active run, stopped mid-loop: ``exactly`` items ending with a single call and its
        result, not answered yet."""
        assert exactly >= 3
        self.run += 1
        self.user()
        left = exactly - 1 - 2  # the last step's call and result
        steps: list[int] = []
        while left > 0:
            k = min(self.calls(), left - 1) if left >= 2 else 0
            if k == 0:  # one item left over: an assistant remark before the steps
                break
            steps.append(k)
            left -= k + 1
        if left:
            self.assistant()
        for k in steps:
            self.step(k)
        self.step(1)


def generate(size: int, seed: int | None = None) -> Conversation:
    """``size`` items, deterministic for a given size (and seed)."""
    if size < 3:
        raise ValueError("a conversation needs at least 3 items")
    seed = SEED + size if seed is None else seed
    b = _Builder(random.Random(seed))
    while True:
        remaining = size - len(b.items)
        if remaining <= 8:
            b.final_turn(remaining)
            break
        b.turn(remaining - 3)  # always leave room for the active turn
    items = tuple(b.items)
    assert len(items) == size
    return Conversation(size=size, seed=seed, items=items, active_run_id=items[-1].run_id,
                        runs=b.run, parallel_steps=b.parallel_steps,
                        tool_results=sum(i.kind == "tool_result" for i in items),
                        result_chars=tuple(b.result_chars))


# ---------------------------------------------------------------- conversions

def to_proto(conv: Conversation) -> list[Any]:
    """The items as ``context_engine.v1`` ConversationItems."""
    from context_engine.v1 import context_engine_pb2 as pb

    trust = {"user": pb.TRUST_LEVEL_USER, "external": pb.TRUST_LEVEL_EXTERNAL_UNTRUSTED}
    out = []
    for it in conv.items:
        common: dict[str, Any] = {"id": it.id, "sequence": it.sequence, "run_id": it.run_id,
                                  "trust": trust[it.trust]}
        if it.kind == "user":
            out.append(pb.ConversationItem(user=pb.UserMessage(text=it.text), **common))
        elif it.kind == "assistant":
            out.append(pb.ConversationItem(assistant=pb.AssistantMessage(text=it.text),
                                           **common))
        elif it.kind == "tool_calls":
            out.append(pb.ConversationItem(tool_calls=pb.ToolCalls(calls=[
                pb.ToolCall(call_id=c.call_id, name=c.name, arguments_json=c.arguments_json)
                for c in it.calls]), **common))
        else:
            out.append(pb.ConversationItem(tool_result=pb.ToolResult(
                call_id=it.call_id, tool_name=it.tool_name, content=it.text,
                event_id=it.sequence), **common))
    return out


def to_langchain(conv: Conversation) -> list[Any]:
    """The same conversation as langchain-core messages, the system prompt first."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

    out: list[Any] = [SystemMessage(content=conv.system)]
    for it in conv.items:
        if it.kind == "user":
            out.append(HumanMessage(content=it.text, id=it.id))
        elif it.kind == "assistant":
            out.append(AIMessage(content=it.text, id=it.id))
        elif it.kind == "tool_calls":
            out.append(AIMessage(content="", id=it.id, tool_calls=[
                {"name": c.name, "args": json.loads(c.arguments_json), "id": c.call_id,
                 "type": "tool_call"} for c in it.calls]))
        else:
            out.append(ToolMessage(content=it.text, tool_call_id=it.call_id, name=it.tool_name,
                                   id=it.id))
    return out
