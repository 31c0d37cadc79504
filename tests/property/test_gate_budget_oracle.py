"""Hard gate: budget conformance, counted by an oracle that shares no code with the estimator
(spec: "The token estimator", "Hard gates").

The budget gate (test_gate_budget.py) recounts with the service's own estimator, so it cannot
see what that estimator forgets. Here every request is rendered as each of the five provider
bodies (``providers.render``: Anthropic Messages, OpenAI Responses and Chat Completions, Gemini
generateContent, Bedrock Converse; all five from one build) and counted by
``tests.support.provider_tokens``: tiktoken's own ``encode`` over what the provider receives —
instructions and system blocks, every message, call ids, tool names and arguments, tool
results, tool definitions and the per-message framing — and the service's
``estimated_input_tokens`` must never be below that count, while the request (by any count)
stays within window - output reserve.

Checkpoints are tool-call heavy: many calls, parallel batches of up to six, long arguments
(nested JSON, long strings, non-ASCII), provider-style call ids, dotted tool names, large
results and replayable reasoning, against small windows so that every rung of the yield ladder
runs. Plans pin tool definitions and are drawn for exact models (gpt-4: cl100k_base, gpt-4o:
o200k_base; base factor 1.0, so the estimate has no slack to hide in) and for Claude (cl100k
at 1.3: the oracle counts cl100k at 1.0, the lower bound of a tokenizer that counts more).
"""

from __future__ import annotations

import functools
import itertools
import json
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from context_engine.domain import providers
from context_engine.domain.budget import BudgetPolicy
from context_engine.domain.builder import (
    BuildResult,
    Checkpoint,
    LoadedPlan,
    RuntimeMetadata,
    build,
)
from context_engine.domain.errors import BudgetExceeded, InvalidInput
from context_engine.domain.items import (
    AssistantMessageItem,
    ConversationItem,
    HistorySummary,
    KnowledgePassage,
    MemoryLine,
    ReasoningItem,
    ToolCallItem,
    ToolResultItem,
    UserMessageItem,
)
from context_engine.domain.model import SideEffect, ToolSpec
from context_engine.domain.request import ToolCall
from context_engine.domain.trust import TrustLevel
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests import factories as f
from tests.support.provider_tokens import BEDROCK_CONVERSE, FORMATS, breakdown, count_body

pytestmark = pytest.mark.gate_budget

ORACLE_SETTINGS = settings(max_examples=70, deadline=None, derandomize=True, database=None,
                           suppress_health_check=[HealthCheck.too_slow,
                                                  HealthCheck.data_too_large])

EXACT_MODELS = ("gpt-4", "gpt-4o")
CLAUDE = "claude-sonnet-4-5"
WINDOWS = (8_192, 12_000, 16_000, 16_000, 24_000, 32_000)
RESERVES = (1_024, 2_048, 4_096)
FACTORS = (1.0, 1.0, 1.0, 1.25)  # a correction factor only ever adds (below 1 it would
# say the provider counts less than the tokenizer, which the oracle does not model)

WORDS = ("alpha", "beta", "gamma", "delta", "Größe", "naïve", "東京", "42", "3.14", "null",
         "{\"id\": 7,", "\"name\":", "<td>", "</td>", "https://example.com/a?b=c", "the",
         "result", "\\n", "🙂", "ok")
BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def words(n: int, seed: int) -> str:
    """About ``n`` words of mixed JSON/HTML/non-ASCII text, deterministic in ``seed``."""
    return " ".join(WORDS[(seed + 7 * i + i // 5) % len(WORDS)] for i in range(max(n, 0)))


# --------------------------------------------------------------------------- plans

def _schema(props: dict[str, Any], required: Sequence[str]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(required)}


TOOLS: tuple[ToolSpec, ...] = (
    f.tool("web.fetch", side_effect=SideEffect.NETWORK_READ,
           description="Fetch a web page and return its text. Follows redirects; honours "
                       "robots.txt. Use for pages the user names.",
           schema=_schema({"url": {"type": "string", "description": "Absolute URL."},
                           "timeout": {"type": "integer", "minimum": 1, "maximum": 60},
                           "headers": {"type": "object",
                                       "additionalProperties": {"type": "string"}}},
                          ["url"])),
    f.tool("files.read", side_effect=SideEffect.WORKSPACE_READ,
           description="Read a file of the workspace.",
           schema=_schema({"path": {"type": "string"},
                           "range": {"type": "array", "items": {"type": "integer"},
                                     "minItems": 2, "maxItems": 2}}, ["path"])),
    f.tool("crm.contacts.search", side_effect=SideEffect.NETWORK_READ,
           description="Search contacts by name, email or company. Returns at most 50.",
           schema=_schema({"query": {"type": "string"},
                           "fields": {"type": "array", "items": {
                               "type": "string", "enum": ["name", "email", "company",
                                                          "phone", "notes"]}},
                           "limit": {"type": "integer"}}, ["query"])),
    f.tool("calendar.events.create", side_effect=SideEffect.NETWORK_WRITE,
           description="Create a calendar event. Attendees get an invitation.",
           schema=_schema({"title": {"type": "string"}, "start": {"type": "string",
                                                                  "format": "date-time"},
                           "end": {"type": "string", "format": "date-time"},
                           "attendees": {"type": "array", "items": {"type": "string"}},
                           "location": {"type": "object", "properties": {
                               "name": {"type": "string"}, "address": {"type": "string"}}}},
                          ["title", "start", "end"])),
    f.tool("shell_exec", side_effect=SideEffect.WORKSPACE_WRITE,
           description="Run a shell command in the sandbox.",
           schema=_schema({"cmd": {"type": "string"}}, ["cmd"])),
)
NAMES = tuple(t.name for t in TOOLS)


@functools.cache
def plan_for(model_id: str, window: int, reserve: int, n_tools: int) -> LoadedPlan:
    tools = TOOLS[:n_tools]
    return f.loaded(f.inputs(
        model_profile=f.model(model_id, context_window=window, output_reserve=reserve),
        instructions="You are a careful assistant. Cite the tool results you rely on, and say "
                     "when a page could not be fetched.",
        enabled=tuple(t.name for t in tools), catalog=tools))


# --------------------------------------------------------------------------- checkpoints

@dataclass(frozen=True)
class OracleCase:
    loaded: LoadedPlan
    cp: Checkpoint
    policy: BudgetPolicy
    factor: float

    def build(self) -> BuildResult:
        return build(self.loaded, self.cp, estimator=f.estimator(self.loaded.plan.spec.model),
                     factor=self.factor, policy=self.policy)


def call_id(style: str, rng: random.Random, k: int) -> str:
    """Call ids as providers mint them: OpenAI ``call_`` + 24, Anthropic ``toolu_01`` + 22
    base62 characters, or a runtime's own short ids."""
    if style == "openai":
        return "call_" + "".join(rng.choice(BASE62) for _ in range(22)) + f"{k:02d}"
    if style == "anthropic":
        return "toolu_01" + "".join(rng.choice(BASE62) for _ in range(20)) + f"{k:02d}"
    return f"c{k}"


def arguments(draw: st.DrawFn, name: str, size: int, seed: int) -> str:
    """Arguments of a call to ``name``: nested JSON with long strings, compact or spaced."""
    n = draw(st.sampled_from((0, 3, 20, size, size)))
    value: dict[str, Any] = {
        "web.fetch": {"url": f"https://example.com/{words(3, seed).replace(' ', '/')}",
                      "timeout": seed % 60, "headers": {"accept": "text/html",
                                                        "x-note": words(n, seed)}},
        "files.read": {"path": f"/work/{seed}/notes.md", "range": [seed, seed + n]},
        "crm.contacts.search": {"query": words(n, seed), "fields": ["name", "email"],
                                "limit": 50},
        "calendar.events.create": {"title": words(min(n, 12), seed),
                                   "start": "2026-11-29T10:00:00+01:00",
                                   "end": "2026-11-29T11:00:00+01:00",
                                   "attendees": [f"p{k}@example.com" for k in range(n // 10)],
                                   "location": {"name": "Raum Größe", "address": words(n, 3)}},
        "shell_exec": {"cmd": "grep -rn 'x' . | " + words(n, seed)},
    }[name]
    if draw(st.booleans()):
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    else:
        text = json.dumps(value, indent=draw(st.sampled_from((None, 2))))
    if draw(st.integers(0, 3)) == 0:  # numbers in exponent form: sent parsed, they grow
        text = text[:-1] + ',"scale":[' + ",".join(exponents(n // 2 + 1, seed)) + "]}"
    return text


def exponents(n: int, seed: int) -> list[str]:
    """``n`` JSON numbers in exponent form (``3e15``, ``7E+15``), each of which a body that
    parses the arguments sends re-serialized, several times longer (``3000000000000000.0``)."""
    return [f"{(seed + k) % 9 + 1}{'eE'[k % 2]}{'+' if k % 3 == 0 else ''}15" for k in range(n)]


# CJK Extension A: three UTF-8 bytes a character, and a tokenizer spends up to three tokens on
# one (a payload's bytes / 3 counts one).
RARE = "".join(chr(0x3400 + 37 * k % 6_500) for k in range(64))


def rare_text(n: int, seed: int) -> str:
    return "".join(RARE[(seed + 11 * k) % len(RARE)] for k in range(n))


@st.composite
def oracle_cases(draw: st.DrawFn, model_ids: Sequence[str]) -> OracleCase:
    model_id = draw(st.sampled_from(tuple(model_ids)), label="model")
    window = draw(st.sampled_from(WINDOWS), label="window")
    reserve = draw(st.sampled_from(RESERVES), label="reserve")
    n_tools = draw(st.integers(0, len(TOOLS)), label="tools")
    loaded = plan_for(model_id, window, reserve, n_tools)
    policy = BudgetPolicy(safety_margin_ratio=draw(st.sampled_from((0.05, 0.0, 0.1))),
                          inline_maximum_bytes=draw(st.sampled_from((16_384, 4_096, 65_536))),
                          recall_floor_tokens=draw(st.sampled_from((500, 0))))
    scale = min(window - reserve, 30_000)
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    style = draw(st.sampled_from(("openai", "anthropic", "short")), label="call ids")
    item_no, call_no, seq = itertools.count(1), itertools.count(1), itertools.count(1)

    def nid() -> str:
        return f"item-{next(item_no)}"

    def n_words(lo: float, hi: float) -> int:
        return int(scale * draw(st.floats(lo, hi)) / 1.6)  # ~1.6 tokens a word

    items: list[ConversationItem] = []
    runs = [f"run-{k}" for k in range(1, draw(st.integers(1, 4)) + 1)]
    new_active = draw(st.booleans())
    active = f"run-{len(runs) + 1}" if new_active else runs[-1]
    for run in runs:
        items.append(UserMessageItem(id=nid(), sequence=next(seq), run_id=run,
                                     item_trust=TrustLevel.USER,
                                     text=words(draw(st.integers(1, 80)), next(item_no))))
        for _ in range(draw(st.integers(1, 6))):
            kind = draw(st.sampled_from(("assistant", "reasoning", "tools", "tools", "tools")))
            if kind == "assistant":
                items.append(AssistantMessageItem(
                    id=nid(), sequence=next(seq), run_id=run, item_trust=TrustLevel.USER,
                    text=words(draw(st.integers(1, 40)) if draw(st.booleans())
                               else n_words(0.0, 0.1), next(item_no))))
            elif kind == "reasoning":
                k = next(item_no)
                thinking = words(draw(st.integers(5, 200)), k) if draw(st.booleans()) \
                    else rare_text(draw(st.integers(5, 400)), k)
                payload: dict[str, Any] = (
                    {"type": "thinking", "thinking": thinking,
                     "signature": "c2ln" * 20} if draw(st.booleans()) else
                    {"type": "reasoning", "id": f"rs_{k}", "encrypted_content": "gAAAA" * 40,
                     "summary": [{"type": "summary_text",
                                  "text": words(draw(st.integers(0, 120)), k)}]})
                provider = "anthropic" if payload["type"] == "thinking" else "openai"
                items.append(ReasoningItem(id=nid(), sequence=next(seq), run_id=run,
                                           item_trust=TrustLevel.USER, provider=provider,
                                           opaque=json.dumps(
                                               payload,
                                               ensure_ascii=draw(st.booleans())).encode()))
            else:
                parallel = draw(st.integers(1, 6), label="parallel calls")
                size = n_words(0.01, 0.12)
                calls = []
                for _ in range(parallel):
                    name = draw(st.sampled_from(NAMES))
                    k = next(call_no)
                    calls.append(ToolCall(call_id=call_id(style, rng, k), name=name,
                                          arguments_json=arguments(draw, name, size, k)))
                if draw(st.integers(0, 3)) == 0:  # the model said something with its calls
                    items.append(AssistantMessageItem(
                        id=nid(), sequence=next(seq), run_id=run, item_trust=TrustLevel.USER,
                        text=words(draw(st.integers(1, 30)), next(item_no))))
                items.append(ToolCallItem(id=nid(), sequence=next(seq), run_id=run,
                                          item_trust=TrustLevel.USER, calls=tuple(calls)))
                for c in draw(st.permutations(calls)):
                    n = draw(st.sampled_from((0, 2, 30, n_words(0.01, 0.08),
                                              n_words(0.05, 0.4))))
                    items.append(ToolResultItem(
                        id=nid(), sequence=next(seq), run_id=run,
                        item_trust=draw(st.sampled_from((TrustLevel.EXTERNAL_UNTRUSTED,
                                                         TrustLevel.USER))),
                        call_id=c.call_id, tool_name=c.name,
                        content=words(n, next(item_no)),
                        artifact_ref=draw(st.sampled_from(("", f"artifact://r/{c.call_id}"))),
                        event_id=draw(st.sampled_from((0, 9_000 + next(item_no))))))
    if new_active or draw(st.booleans()):
        items.append(UserMessageItem(id=nid(), sequence=next(seq), run_id=active,
                                     item_trust=TrustLevel.USER,
                                     text=words(draw(st.integers(1, 120)), next(item_no))))
    summary = None
    if len(runs) > 1 and draw(st.integers(0, 3)) == 0:
        through = max(i.sequence for i in items if i.run_id == runs[0])
        summary = HistorySummary(text=words(draw(st.integers(5, 150)), 5),
                                 replaced_through_sequence=through)
    knowledge = tuple(KnowledgePassage(id=f"kp-{k}", source="handbook",
                                       text=words(draw(st.integers(10, 600)), k), rank=k,
                                       trust=TrustLevel.EXTERNAL_UNTRUSTED)
                      for k in range(draw(st.integers(0, 3))))
    recall = tuple(MemoryLine(id=f"m-{k}", text=words(draw(st.integers(3, 300)), k))
                   for k in range(draw(st.integers(0, 3))))
    cp = Checkpoint(active_run_id=active, items=tuple(items), knowledge=knowledge,
                    recall=recall, runtime=RuntimeMetadata(current_date="2026-11-29"),
                    summary=summary)
    return OracleCase(loaded=loaded, cp=cp, policy=policy,
                      factor=draw(st.sampled_from(FACTORS), label="factor"))


# --------------------------------------------------------------------------- the check

def check_against_oracle(r: BuildResult) -> dict[str, float]:
    """The estimate is never below the oracle's count of either provider body, and the request
    fits window - output reserve by both counts. Returns estimate / oracle per format."""
    limit = r.context_window - r.output_reserve
    assert r.estimated_input_tokens <= limit
    assert set(providers.FORMATS) == set(FORMATS), "the oracle counts every format"
    ratios: dict[str, float] = {}
    for fmt in providers.FORMATS:
        if fmt in (BEDROCK_CONVERSE, providers.ANTHROPIC_MESSAGES) and not r.request.tools \
                and any(m.tool_calls for m in r.request.messages):
            # Bedrock and Anthropic refuse calls in a request without tools, and so does the
            # renderer
            with pytest.raises(InvalidInput, match="defines tools"):
                providers.render(r, fmt)
            event(f"{fmt}: calls without tools, refused")
            continue
        body = providers.render(r, fmt)
        counted = count_body(body, fmt, r.model_id)
        assert counted <= r.estimated_input_tokens, (
            f"{r.model_id} {fmt}: the provider receives {counted} tokens, the service "
            f"estimated {r.estimated_input_tokens} (prefix {r.prefix_tokens}, body "
            f"{r.body_tokens}); oracle parts {breakdown(body, fmt, r.model_id)}")
        assert counted <= limit, f"{fmt}: {counted} tokens exceed window - reserve {limit}"
        ratios[fmt] = r.estimated_input_tokens / counted
    return ratios


def run_case(case: OracleCase) -> dict[str, float] | None:
    try:
        r = case.build()
    except BudgetExceeded as e:
        event(f"budget exceeded: {e.class_name}")
        return None
    for step in r.pressure.steps:
        event(f"yielded: {step.step}")
    event(f"tool calls sent: {'many' if _calls(r) >= 6 else 'few'}")
    return check_against_oracle(r)


def _calls(r: BuildResult) -> int:
    return sum(len(m.tool_calls) for m in r.request.messages)


@ORACLE_SETTINGS
@given(case=oracle_cases(EXACT_MODELS))
def test_exact_models_never_estimate_below_what_the_provider_receives(case: OracleCase) -> None:
    run_case(case)


@ORACLE_SETTINGS
@given(case=oracle_cases((CLAUDE,)))
def test_claude_never_estimates_below_what_the_provider_receives(case: OracleCase) -> None:
    run_case(case)


# --------------------------------------------------------------------------- fixed cases

def heavy_case(model_id: str, window: int, batches: int, parallel: int,
               style: str = "openai") -> OracleCase:
    """A deterministic tool-call-heavy checkpoint: ``batches`` parallel batches of long
    arguments and mid-sized results, then the trailing question."""
    rng = random.Random(7)
    items: list[ConversationItem] = [f.user("u0", "Compare these pages.", 1, run="run-1")]
    seq = itertools.count(2)
    for b in range(batches):
        calls = tuple(ToolCall(call_id=call_id(style, rng, b * parallel + k), name=name,
                               arguments_json=json.dumps({"q": words(60, k), "n": k}))
                      for k, name in zip(range(parallel), itertools.cycle(NAMES)))
        items.append(ToolCallItem(id=f"c{b}", sequence=next(seq), run_id="run-1",
                                  item_trust=TrustLevel.USER, calls=calls))
        items += [ToolResultItem(id=f"r{b}-{k}", sequence=next(seq), run_id="run-1",
                                 item_trust=TrustLevel.EXTERNAL_UNTRUSTED, call_id=c.call_id,
                                 tool_name=c.name, content=words(150, k))
                  for k, c in enumerate(calls)]
    items.append(f.user("u9", "And which is newer?", next(seq), run="run-2"))
    return OracleCase(loaded=plan_for(model_id, window, 2_048, len(TOOLS)),
                      cp=f.checkpoint(items, run="run-2"), policy=BudgetPolicy(), factor=1.0)


@pytest.mark.parametrize("model_id", [*EXACT_MODELS, CLAUDE])
def test_a_heavy_tool_history_yields_and_still_fits_by_the_oracle(model_id: str) -> None:
    """The scenario the properties draw at random, fixed: the body must yield (tool results to
    pointers, history cut), and every request still holds by the oracle's count."""
    case = heavy_case(model_id, 16_000, batches=12, parallel=4)
    r = case.build()
    assert {s.step for s in r.pressure.steps} >= {"tool_results", "history"}
    assert _calls(r) >= 4
    ratios = check_against_oracle(r)
    assert set(ratios) == set(FORMATS)  # the plan pins tools: Bedrock renders too
    assert min(ratios.values()) >= 1.0


@pytest.mark.parametrize("model_id", EXACT_MODELS)
def test_an_exact_model_estimates_calls_to_within_their_framing(model_id: str) -> None:
    """Not absurd either way: on an exact model the estimate of a call-heavy request stays
    within 3% of both OpenAI bodies' counts (one input item per message and per call, as the
    estimator frames them; Chat Completions frames each call of an assistant message like an
    item), so neither count leaves out much the other has. (The Anthropic, Bedrock and Gemini
    bodies merge consecutive messages into one turn and frame less; the estimate also covers
    what Gemini alone sends, a result as ``{"output": text}`` and its function's name.)"""
    r = heavy_case(model_id, 200_000, batches=6, parallel=6).build()
    assert not r.pressure.steps and _calls(r) == 36
    ratios = check_against_oracle(r)
    assert set(ratios) == set(FORMATS)
    assert ratios[providers.OPENAI_RESPONSES] <= 1.03, ratios
    assert ratios["openai_chat_completions"] <= 1.03, ratios
    for fmt in (providers.ANTHROPIC_MESSAGES, BEDROCK_CONVERSE, "gemini_generate_content"):
        assert ratios[fmt] <= 1.2, ratios


def single_batch_case(model_id: str, calls: Sequence[ToolCall],
                      reasoning: bytes = b"", provider: str = "anthropic") -> OracleCase:
    """The active run: the question, optionally a reasoning item, one batch of ``calls`` with
    short results (the reasoning is replayed with the calls it led to); a window that needs no
    yielding."""
    items: list[ConversationItem] = [f.user("u0", "Go on.", 1, run="run-1")]
    seq = itertools.count(2)
    if reasoning:
        items.append(ReasoningItem(id="rs", sequence=next(seq), run_id="run-1",
                                   item_trust=TrustLevel.USER, provider=provider,
                                   opaque=reasoning))
    if calls:
        items.append(ToolCallItem(id="c", sequence=next(seq), run_id="run-1",
                                  item_trust=TrustLevel.USER, calls=tuple(calls)))
        items += [ToolResultItem(id=f"r{k}", sequence=next(seq), run_id="run-1",
                                 item_trust=TrustLevel.USER, call_id=c.call_id,
                                 tool_name=c.name, content="ok")
                  for k, c in enumerate(calls)]
    return OracleCase(loaded=plan_for(model_id, 200_000, 2_048, len(TOOLS)),
                      cp=f.checkpoint(items, run="run-1"), policy=BudgetPolicy(), factor=1.0)


@pytest.mark.parametrize("model_id", EXACT_MODELS)
def test_arguments_are_counted_as_the_bodies_that_parse_them_send_them(model_id: str) -> None:
    """OpenAI sends a call's arguments verbatim; Anthropic, Gemini and Bedrock send the parsed
    object, re-serialized: ``3e15`` arrives as ``3000000000000000.0``. The estimate covers the
    longer form, by the oracle's count of each body."""
    calls = [ToolCall(call_id=f"call_{k}", name="web.fetch",
                      arguments_json='{"url":"https://example.com","scale":['
                                     + ",".join(exponents(200, k)) + "]}")
             for k in range(4)]
    ratios = check_against_oracle(single_batch_case(model_id, calls).build())
    assert set(ratios) == set(FORMATS)


@pytest.mark.parametrize("model_id", EXACT_MODELS)
def test_reasoning_text_of_rare_characters_is_counted_by_the_tokenizer(model_id: str) -> None:
    """Thinking text of rare characters (three UTF-8 bytes each, up to three tokens each):
    the payload's bytes / 3 would count one token a character; the Anthropic body sends the
    text, and the estimate covers the tokenizer's count of it."""
    payload = {"type": "thinking", "thinking": rare_text(3_000, 1), "signature": "c2ln"}
    opaque = json.dumps(payload, ensure_ascii=False).encode()
    call = ToolCall(call_id="call_1", name="files.read", arguments_json='{"path":"/a"}')
    r = single_batch_case(model_id, [call], opaque).build()
    assert any(m.reasoning_opaque == opaque for m in r.request.messages)
    ratios = check_against_oracle(r)
    assert set(ratios) == set(FORMATS)


# Dotted names: "." is one token beside a letter, the "__" every body but Gemini's sends is
# usually more; a leading digit gets Gemini's "_".
DOTTED = tuple(
    f.tool(name, description="d", schema={"type": "object"})
    for name in ("a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p.q.r.s.t.u",
                 "x.y.z.w.v.u.t.s.r.q.p.o.n.m.l.k.j.i.h.g.f",
                 "q1.w2.e3.r4.t5.y6.u7.i8.o9.p0.a1.s2.d3.f4",
                 "9.z.y.x.w.v.u.t.s.r.q.p.o.n.m.l.k.j.i.h"))


@pytest.mark.parametrize("model_id", [*EXACT_MODELS, CLAUDE])
def test_tool_definitions_are_counted_by_the_names_the_bodies_send(model_id: str) -> None:
    """The plan's tool-definition class covers what every body spends on its tool
    definitions (each "." sent as "__", Gemini's leading "_"): the prefix measure, not the
    whole request's slack, is what is checked."""
    loaded = f.loaded(f.inputs(
        model_profile=f.model(model_id, context_window=200_000, output_reserve=2_048),
        instructions="Use the tools.", enabled=tuple(t.name for t in DOTTED), catalog=DOTTED))
    tools_class = next(c for c in loaded.plan.classes if c.class_name == "tool_definitions")
    cp = f.checkpoint([f.user("u0", "Go.", 1)])
    r = build(loaded, cp, estimator=f.estimator(loaded.plan.spec.model))
    for fmt in providers.FORMATS:
        parts = breakdown(providers.render(r, fmt), fmt, r.model_id)
        sent = parts.get("tools", 0) + parts.get("tool_framing", 0)
        assert sent <= tools_class.tokens, (fmt, sent, tools_class.tokens)
    check_against_oracle(r)


def ratio_figures(model_ids: Sequence[str], examples: int) -> dict[tuple[str, str], str]:
    """min and median of estimate / oracle per model and format (for the report; not a
    test)."""
    found: dict[tuple[str, str], list[float]] = {}

    @settings(ORACLE_SETTINGS, max_examples=examples)
    @given(case=oracle_cases(model_ids))
    def collect(case: OracleCase) -> None:
        ratios = run_case(case)
        for fmt, ratio in (ratios or {}).items():
            found.setdefault((case.loaded.plan.spec.model.model_id, fmt), []).append(ratio)

    collect()
    return {key: f"n={len(v)} min={min(v):.3f} median={statistics.median(v):.3f}"
            for key, v in sorted(found.items())}
