"""Hard gate: tool-pair integrity (spec: "Yield order under pressure", "Failure modes and
defenses", "Hard gates").

No assembled request, under any yield path (knowledge dropped, recall trimmed, tool results
turned into pointers, history cut, a summary floor inside a pair), holds an unpaired tool call
or tool result, nor does any provider body rendered from it (Anthropic: each assistant
tool_use turn answered by the next user turn's tool_results; OpenAI Responses: each
function_call answered once, after it; Chat Completions, Gemini and Bedrock by the independent
validator of ``tests/support/tool_pairs.py``: each call answered in the place its wire format
requires, Gemini's responses in the order of their calls, roles alternating where the API
requires it); every enveloped text of the request reads, in every body, exactly as it reads in
the request (``tests/support/envelope_parser.py``); a request built by hand with an orphan is
rejected by the validator. Every example renders all five formats from one build.

The generator here (``pressured_cases``, also used by the budget gate) draws plans with small
windows (16k to 1M, output reserves and policy caps) and checkpoints with tool exchanges
(``tool_exchanges`` in strategies.py: parallel calls, a second call item before the first
one's results, results arriving before a later call item, parallel results out of order,
messages and reasoning between call items), huge results, replayable reasoning of both
providers, summaries, knowledge, recall and pending results of the active loop, sized against
the window so that every rung of the yield ladder runs. The pairing checks are written here,
independently of ``pairs.py`` and ``providers.py``.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest
from context_engine.domain import pairs, providers
from context_engine.domain.budget import BudgetPolicy
from context_engine.domain.builder import (
    BuildResult,
    Checkpoint,
    LoadedPlan,
    RuntimeMetadata,
    SkillBody,
    assert_paired,
    build,
)
from context_engine.domain.errors import AssemblyError, BudgetExceeded, InvalidInput
from context_engine.domain.items import (
    AssistantMessageItem,
    ContextItem,
    ConversationItem,
    HistorySummary,
    KnowledgeItem,
    KnowledgePassage,
    MemoryLine,
    ReasoningItem,
    RecallItem,
    RenderContext,
    ToolCallItem,
    ToolResultItem,
    TrailingUserInput,
    UserMessageItem,
    WorkingState,
)
from context_engine.domain.request import (
    Message,
    ModelRequest,
    Role,
    ToolCall,
    ToolDefinition,
)
from context_engine.domain.trust import TrustLevel
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests import factories as f
from tests.property.strategies import CALL, RESULT, tool_exchanges
from tests.support import envelope_parser, tool_pairs

pytestmark = pytest.mark.gate_tool_pairs

GATE_SETTINGS = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                         suppress_health_check=[HealthCheck.too_slow,
                                                HealthCheck.data_too_large,
                                                HealthCheck.filter_too_much])

# Classes the builder may name when it fails instead of dropping something: the never-yield
# rows of Region B (spec table and "Four things never yield") and the active run's items.
NEVER_YIELD = frozenset({"current_user_message", "working_state", "corrections",
                         "skill_bodies", "summary", "runtime_metadata", "active_run"})

MODEL_IDS = ("claude-sonnet-4-5", "gpt-4o")
WINDOWS = (16_000, 16_000, 20_000, 24_000, 32_000, 48_000, 64_000, 128_000, 200_000,
           1_000_000)
WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "omega",
         "ok", "42", "{\"id\": 7,", "\"name\":", "<td>", "</td>", "null}", "the", "result")


def words(n: int, seed: int) -> str:
    """About ``n`` words of JSON/HTML-ish text, deterministic in ``seed``: word ``i`` is
    ``WORDS[(seed + 7 * i + i // 5) % len(WORDS)]``, a sequence of period 5 (7 * 5 + 1 is a
    multiple of len(WORDS)), so it is built from one repeated block."""
    block = _block(seed % len(WORDS))
    whole, rest = divmod(max(n, 0), 5)
    return " ".join([*([" ".join(block)] * whole), *block[:rest]])


@functools.cache
def _block(seed: int) -> tuple[str, ...]:
    return tuple(WORDS[(seed + 7 * i + i // 5) % len(WORDS)] for i in range(5))


def reasoning_payload(provider: str, seed: int, n: int) -> bytes:
    """A replayable reasoning item of ``provider`` (its own JSON object, about ``n`` words)."""
    if provider == "anthropic":
        value = {"type": "thinking", "thinking": words(n, seed), "signature": f"c2ln{seed}"}
    else:
        value = {"type": "reasoning", "id": f"rs_{seed}", "summary": [],
                 "encrypted_content": words(n, seed)}
    return json.dumps(value).encode()


@functools.cache
def loaded_for(model_id: str, window: int, reserve: int | None,
               skills: bool = False) -> LoadedPlan:
    """A plan for the model; with ``skills``, a catalog of three skills a checkpoint may load
    (and skill.load among the tools)."""
    caps = {"context_window": window}
    if reserve is not None:
        caps["output_reserve"] = reserve
    return f.loaded(f.inputs(
        model_profile=f.model(model_id, **caps),
        skills=f.skill_catalog("skill-0", "skill-1", "skill-2") if skills else ()))


# --------------------------------------------------------------------------- the case

@dataclass(frozen=True)
class Case:
    loaded: LoadedPlan
    cp: Checkpoint
    policy: BudgetPolicy
    factor: float

    @property
    def estimator(self):  # type: ignore[no-untyped-def]
        return f.estimator(self.loaded.plan.spec.model)

    def build(self) -> BuildResult:
        return build(self.loaded, self.cp, estimator=self.estimator, factor=self.factor,
                     policy=self.policy)


@dataclass(frozen=True)
class Split:
    """The checkpoint's items as the spec divides them (computed here, not by the builder)."""

    trailing: tuple[UserMessageItem, ...]  # unanswered trailing user input: never yields
    carried: tuple[ConversationItem, ...]  # history candidates (older runs' reasoning removed)
    active: tuple[ConversationItem, ...]  # the active run's items: never cut
    pending: frozenset[str]  # ids of results of the active loop's latest, unanswered batch
    floor: int  # index into carried of the first candidate above the summary floor


def split(cp: Checkpoint) -> Split:
    items = list(cp.items)
    t = len(items)
    # the current input: the active run's unanswered user messages at the end (an earlier
    # run's unanswered message is carried history)
    while t > 0 and isinstance(items[t - 1], UserMessageItem) and (
            not cp.active_run_id or items[t - 1].run_id == cp.active_run_id):
        t -= 1
    trailing = tuple(i for i in items[t:] if isinstance(i, UserMessageItem))
    rest = items[:t]
    a = len(rest)
    while a > 0 and rest[a - 1].run_id == cp.active_run_id:
        a -= 1
    carried = tuple(i for i in rest[:a] if not isinstance(i, ReasoningItem))
    active = tuple(rest[a:])
    # The model is only ever called with every call answered, so the results it has not read
    # are those after the last point, before the active run's last call item, at which no
    # call was open; none once anything but a result ends the run (the model answered).
    pending: set[str] = set()
    called_at = {c.call_id: k for k, i in enumerate(active) if isinstance(i, ToolCallItem)
                 for c in i.calls}
    answered_at = {i.call_id: k for k, i in enumerate(active) if isinstance(i, ToolResultItem)}
    if active and isinstance(active[-1], ToolResultItem) and called_at:
        last_call = max(called_at.values())
        start = max(q for q in range(last_call + 1)
                    if not any(called_at[c] < q <= answered_at[c] for c in called_at))
        pending = {i.id for i in active[start:] if isinstance(i, ToolResultItem)}
    floor = 0
    if cp.summary is not None:
        rts = cp.summary.replaced_through_sequence
        floor = next((k for k, i in enumerate(carried) if i.sequence > rts), len(carried))
        where_called = {c.call_id: k for k, i in enumerate(carried)
                        if isinstance(i, ToolCallItem) for c in i.calls}
        moved = True
        while moved:  # never start inside a pair: move past it
            moved = False
            for k, i in enumerate(carried):
                if (isinstance(i, ToolResultItem) and k >= floor
                        and where_called.get(i.call_id, k) < floor):
                    floor, moved = k + 1, True
    return Split(trailing=trailing, carried=carried, active=active,
                 pending=frozenset(pending), floor=floor)


# --------------------------------------------------------------------------- generator

@st.composite
def pressured_cases(draw: st.DrawFn, *, recall_floor: int | None = None,
                    allow_failures: bool = True) -> Case:
    model_id = draw(st.sampled_from(MODEL_IDS), label="model")
    window = draw(st.sampled_from(WINDOWS), label="window")
    reserve = draw(st.sampled_from((None, 1_024, 4_096, 8_192)), label="output reserve")
    cap = draw(st.sampled_from((0, 0, 0, 20_000, 40_000)), label="policy cap")
    policy = BudgetPolicy(
        safety_margin_ratio=draw(st.sampled_from((0.05, 0.05, 0.0, 0.1))),
        policy_cap_tokens=cap,
        inline_maximum_bytes=draw(st.sampled_from((16_384, 16_384, 4_096, 65_536))),
        recall_floor_tokens=(recall_floor if recall_floor is not None
                             else draw(st.sampled_from((500, 500, 0, 200)))))
    default_reserve = f.model(model_id).output_reserve
    if reserve is None and default_reserve * 2 > window:
        reserve = 4_096
    with_skills = draw(st.booleans(), label="skill catalog")
    lp = loaded_for(model_id, window, reserve, with_skills)
    model = lp.plan.spec.model
    capacity = min(window, cap or window) - model.output_reserve
    # Content is sized against what can fit (bounded, to keep the 1M window fast): a 1M
    # window without a policy cap mostly exercises the path where nothing yields.
    scale = max(min(capacity, 60_000), 2_000)

    def size(lo: float, hi: float) -> int:
        return int(scale * draw(st.floats(lo, hi)))

    item_no = itertools.count(1)
    call_no = itertools.count(1)
    seq = draw(st.integers(1, 100))

    def nid() -> str:
        return f"item-{next(item_no)}"

    def nseq() -> int:
        nonlocal seq
        seq += draw(st.sampled_from((0, 1, 1, 2)))
        return seq

    def text(label: str) -> str:
        kind = draw(st.sampled_from(("tiny", "small", "medium", "large", "large")), label=label)
        n = {"tiny": draw(st.integers(0, 6)), "small": draw(st.integers(5, 60)),
             "medium": size(0.005, 0.05), "large": size(0.05, 0.35)}[kind]
        return words(n, next(item_no))

    items: list[ConversationItem] = []
    runs = [f"run-{k}" for k in range(1, draw(st.integers(1, 4)) + 1)]
    new_active = draw(st.integers(0, 4)) == 0
    active = f"run-{len(runs) + 1}" if new_active else runs[-1]
    def assistant(run: str, label: str) -> None:
        items.append(AssistantMessageItem(id=nid(), sequence=nseq(), run_id=run,
                                          item_trust=TrustLevel.USER, text=text(label)))

    def reasoning(run: str) -> None:
        provider = draw(st.sampled_from(("anthropic", "anthropic", "openai")))
        items.append(ReasoningItem(id=nid(), sequence=nseq(), run_id=run,
                                   item_trust=TrustLevel.USER, provider=provider,
                                   opaque=reasoning_payload(provider, next(item_no),
                                                            draw(st.integers(0, 400)))))

    def exchange(run: str, sizes: tuple[str, ...] = ("tiny", "small", "medium", "huge",
                                                      "huge"), early_one_in: int = 3) -> None:
        batches: list[tuple[ToolCall, ...]] = []
        for kind, k, n in draw(tool_exchanges(early_one_in=early_one_in)):
            if kind == CALL:
                batches.append(tuple(
                    ToolCall(call_id=f"call_{next(call_no)}",
                             name=draw(st.sampled_from(("web.fetch", "files.read"))),
                             arguments_json=json.dumps({"q": seq}))
                    for _ in range(n)))
                items.append(ToolCallItem(id=nid(), sequence=nseq(), run_id=run,
                                          item_trust=TrustLevel.USER, calls=batches[k]))
            elif kind == RESULT:
                c = batches[k][n]
                size_kind = draw(st.sampled_from(sizes))
                m = {"tiny": draw(st.integers(0, 4)), "small": draw(st.integers(5, 80)),
                     "medium": size(0.01, 0.08), "huge": size(0.08, 0.6)}[size_kind]
                content = words(m, next(item_no))
                excerpt = words(draw(st.integers(3, 40)), 1) if draw(
                    st.integers(0, 5)) == 0 else ""
                items.append(ToolResultItem(
                    id=nid(), sequence=nseq(), run_id=run,
                    item_trust=draw(st.sampled_from((TrustLevel.EXTERNAL_UNTRUSTED,
                                                     TrustLevel.EXTERNAL_UNTRUSTED,
                                                     TrustLevel.USER, TrustLevel.MEMORY))),
                    call_id=c.call_id, tool_name=c.name, content=content,
                    context_content=excerpt,
                    event_id=draw(st.sampled_from((0, 1000 + seq))),
                    artifact_ref=draw(st.sampled_from(("", f"artifact://r/{seq}")))))
            elif draw(st.booleans()):
                assistant(run, "between calls")
            else:
                reasoning(run)

    for run in runs:
        items.append(UserMessageItem(id=nid(), sequence=nseq(), run_id=run,
                                     item_trust=TrustLevel.USER, text=text("user")))
        for _ in range(draw(st.integers(0, 6))):
            kind = draw(st.sampled_from(("assistant", "reasoning", "tools", "tools", "tools")))
            if kind == "assistant":
                assistant(run, "assistant")
            elif kind == "reasoning":
                reasoning(run)
            else:
                exchange(run)
        if run == runs[-1] and not new_active:
            ending = draw(st.sampled_from(("answer", "loop", "loop", "as drawn")))
            if ending == "answer":
                items.append(AssistantMessageItem(id=nid(), sequence=nseq(), run_id=run,
                                                  item_trust=TrustLevel.USER,
                                                  text=text("answer")))
            elif ending == "loop":  # the active loop waits on its latest batch (never-yield)
                exchange(run, ("tiny", "small", "medium", "medium", "huge"), early_one_in=1)
    n_trailing = draw(st.integers(1 if new_active else 0, 2))
    for _ in range(n_trailing):
        big = allow_failures and draw(st.integers(0, 14)) == 7
        body = words(size(0.5, 1.3), 3) if big else text("trailing")
        items.append(UserMessageItem(id=nid(), sequence=nseq(), run_id=active,
                                     item_trust=TrustLevel.USER, text=body))

    summary = None
    if draw(st.integers(0, 2)) == 0:
        # A summary replaces only what came before the active run (the service rejects a
        # floor that covers the active run's items).
        seqs = [i.sequence for i in items]
        first_active = min(i.sequence for i in items if i.run_id == active)
        summary = HistorySummary(text=words(draw(st.integers(5, 200)), 5),
                                 replaced_through_sequence=draw(st.integers(
                                     min(seqs) - 1, max(min(seqs) - 1, first_active - 1))))
    ranks = st.integers(0, 6)
    knowledge = tuple(KnowledgePassage(id=f"kp-{k}", source="handbook",
                                       text=words(draw(st.integers(10, 1_400)), k),
                                       rank=draw(ranks), trust=TrustLevel.EXTERNAL_UNTRUSTED)
                      for k in range(draw(st.integers(0, 5))))
    recall = tuple(MemoryLine(id=f"m-{k}", text=words(draw(st.integers(3, 700)), k))
                   for k in range(draw(st.integers(0, 6))))
    corrections = tuple(MemoryLine(id=f"c-{k}", text=words(draw(st.integers(3, 40)), k))
                        for k in range(draw(st.integers(0, 2))))
    ws_words = draw(st.sampled_from((0, 0, 20, 200)))
    if allow_failures and draw(st.integers(0, 29)) == 13:
        ws_words = 1_200  # over the working-state class's 1,000 tokens
    working_state = WorkingState(objective=words(ws_words, 9)) if ws_words else WorkingState()
    n_skills = draw(st.sampled_from((0, 1, 2))) if with_skills else 0
    if with_skills and allow_failures and draw(st.integers(0, 19)) == 17:
        n_skills = 3  # a third loaded skill fails rather than evicting
    skills = tuple(SkillBody(name=f"skill-{k}", body=words(draw(st.integers(5, 400)), k),
                             trust=TrustLevel.TRUSTED_CONFIGURATION) for k in range(n_skills))
    cp = Checkpoint(active_run_id=active, items=tuple(items), loaded_skills=skills,
                    working_state=working_state, recall=recall, corrections=corrections,
                    knowledge=knowledge, runtime=RuntimeMetadata(current_date="2026-11-29"),
                    summary=summary)
    return Case(loaded=lp, cp=cp, policy=policy,
                factor=draw(st.sampled_from((1.0, 1.0, 1.1, 1.37)), label="factor"))


# --------------------------------------------------------------------------- the check

def check_paired(messages: Sequence[Message]) -> None:
    """Independent of ``pairs.orphans``: every tool message answers a call made in an earlier
    assistant message, every call has exactly one result, and only conversation messages
    (row 10: the exchange's other calls and results, its messages and reasoning) sit between a
    call and its results. Calls may interleave (a second call message before the first one's
    results); what each provider's wire format requires of that is checked on the rendered
    bodies (``check_provider_bodies``)."""
    made: dict[str, int] = {}
    answered: dict[str, int] = {}
    for k, m in enumerate(messages):
        if m.role is Role.TOOL:
            assert m.call_id in made and made[m.call_id] < k, \
                f"message {k} answers {m.call_id!r}, which no earlier message called"
            assert not m.tool_calls
            assert m.call_id not in answered, f"{m.call_id!r} answered twice"
            answered[m.call_id] = k
        for call in m.tool_calls:
            assert m.role is Role.ASSISTANT
            assert call.call_id not in made, f"{call.call_id!r} called twice"
            made[call.call_id] = k
    assert set(answered) == set(made), \
        f"calls without results: {sorted(set(made) - set(answered))}"
    for call_id, k in made.items():
        between = {m.row for m in messages[k:answered[call_id] + 1]}
        assert between == {10}, f"rows {sorted(between)} between {call_id!r} and its result"


def check_provider_bodies(r: BuildResult) -> dict[str, dict[str, Any]]:
    """Every provider body keeps every pair. ``providers.render`` runs our own validator; the
    pairing is checked again here, independently. Anthropic: roles alternate from a user turn;
    the tool_use blocks of an assistant turn are answered, each exactly once, by the
    tool_result blocks that open the next user turn, and a turn's tool_results answer only the
    turn right before it. OpenAI Responses: every function_call has exactly one
    function_call_output after it, and every output has its call. Every format (these two,
    Chat Completions, Gemini and Bedrock) also passes ``tool_pairs``' validator, sends every
    call of the request, and keeps every envelope as the request has it."""
    calls = sorted(c.call_id for m in r.request.messages for c in m.tool_calls)
    r = with_called_tools(r)
    bodies = {fmt: providers.render(r, fmt) for fmt in providers.FORMATS}
    assert len(bodies) == 5, f"the five formats, not {sorted(bodies)}"

    turns = bodies[providers.ANTHROPIC_MESSAGES]["messages"]
    assert turns and turns[0]["role"] == "user"
    assert all(a["role"] != b["role"] for a, b in itertools.pairwise(turns))
    uses_of: list[list[str]] = []
    results_of: list[list[str]] = []
    for t in turns:
        kinds = [b["type"] for b in t["content"]]
        results = [b["tool_use_id"] for b in t["content"] if b["type"] == "tool_result"]
        assert kinds[:len(results)] == ["tool_result"] * len(results), \
            f"tool_result blocks do not open their turn: {kinds}"
        uses_of.append([b["id"] for b in t["content"] if b["type"] == "tool_use"])
        results_of.append(results)
    for i, (uses, results) in enumerate(zip(uses_of, results_of, strict=True)):
        if uses:
            assert turns[i]["role"] == "assistant"
            assert i + 1 < len(turns) and sorted(results_of[i + 1]) == sorted(uses), (
                f"turn {i} calls {sorted(uses)}; the next turn answers "
                f"{sorted(results_of[i + 1]) if i + 1 < len(turns) else 'nothing'}")
        if results:
            assert turns[i]["role"] == "user" and i > 0
            assert sorted(results) == sorted(uses_of[i - 1]), \
                f"turn {i} answers {sorted(results)}, the turn before called {uses_of[i - 1]}"
    assert sorted(c for uses in uses_of for c in uses) == calls

    made: dict[str, int] = {}
    outputs: Counter[str] = Counter()
    for k, item in enumerate(bodies[providers.OPENAI_RESPONSES]["input"]):
        if item.get("type") == "function_call":
            assert item["call_id"] not in made
            made[item["call_id"]] = k
        elif item.get("type") == "function_call_output":
            assert item["call_id"] in made, f"output {item['call_id']!r} before its call"
            outputs[item["call_id"]] += 1
    assert sorted(made) == calls and outputs == Counter(calls)

    # The other formats, by the independent validator; each sends every call of the request.
    for fmt in providers.FORMATS:
        assert tool_pairs.problems_of(bodies[fmt], fmt) == [], \
            f"{fmt}: {tool_pairs.problems_of(bodies[fmt], fmt)}"
        sent = sent_calls(bodies[fmt], fmt)
        if None in sent:  # Gemini pairs a call without an id by name, in order
            assert len(sent) == len(calls), fmt
        else:
            assert sorted(sent) == calls, fmt  # type: ignore[type-var]
    check_envelopes(r, bodies)
    return bodies


def with_called_tools(r: BuildResult) -> BuildResult:
    """``r`` with a definition for every tool its messages call and its plan does not define.
    Anthropic and Bedrock refuse calls in a request without tools (the Bedrock renderer
    refuses to render one: ``test_a_bedrock_body_needs_the_tools_its_calls_use``); the gate's
    plans pin no tools, and a definition changes no pair and no envelope."""
    defined = {t.name for t in r.request.tools}
    missing = sorted({c.name for m in r.request.messages for c in m.tool_calls} - defined)
    if not missing:
        return r
    extra = tuple(ToolDefinition(name=n, description=f"Test tool {n}.",
                                 input_schema_json='{"type":"object"}') for n in missing)
    return replace(r, request=replace(r.request, tools=(*r.request.tools, *extra)))


def sent_calls(body: dict[str, Any], fmt: str) -> list[str | None]:
    """The call ids a body sends (None for a Gemini call without one)."""
    if fmt == providers.ANTHROPIC_MESSAGES:
        return [b["id"] for t in body["messages"] for b in t["content"]
                if b["type"] == "tool_use"]
    if fmt == providers.OPENAI_RESPONSES:
        return [i["call_id"] for i in body["input"] if i.get("type") == "function_call"]
    if fmt == "openai_chat_completions":
        return [c["id"] for m in body["messages"] for c in m.get("tool_calls") or []]
    if fmt == "gemini_generate_content":
        return [p["functionCall"].get("id") for c in body["contents"] for p in c["parts"]
                if "functionCall" in p]
    if fmt == "bedrock_converse":
        return [b["toolUse"]["toolUseId"] for m in body["messages"] for b in m["content"]
                if "toolUse" in b]
    raise AssertionError(f"no reading of {fmt!r} bodies")


def json_strings(value: Any) -> list[str]:
    """Every string value of a JSON body, depth first (keys are field names, not content)."""
    out: list[str] = []
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, dict):
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
    return out


def envelopes(texts: Sequence[str]) -> Counter[tuple[str, str, str, str, str]]:
    found: Counter[tuple[str, str, str, str, str]] = Counter()
    for text in texts:
        if "nonce=" in text:
            for e in envelope_parser.parse(text):
                found[(e.tag, e.source, e.item_id, e.nonce, e.body(text))] += 1
    return found


def check_envelopes(r: BuildResult, bodies: dict[str, dict[str, Any]]) -> None:
    """Every envelope of the request (prefix blocks and messages), read strictly by the
    independent parser, is in every body once, with the same tag, source, id, nonce and body:
    no renderer splits, merges, escapes, drops or repeats enveloped text."""
    expected = envelopes([*(b.text for b in r.request.prefix_blocks),
                          *(m.text for m in r.request.messages)])
    assert expected, "the request holds no envelope: nothing to check"
    for fmt, body in bodies.items():
        got = envelopes(json_strings(body))
        assert got == expected, (
            f"{fmt}: envelopes missing {sorted(k[2] for k in expected - got)}, extra "
            f"{sorted(k[2] for k in got - expected)}")


def steps_of(r: BuildResult) -> tuple[str, ...]:
    return tuple(s.step for s in r.pressure.steps)


def build_or_fail_on_a_never_yield_class(case: Case) -> BuildResult | None:
    try:
        return case.build()
    except BudgetExceeded as e:
        assert e.class_name in NEVER_YIELD, f"failed naming a class that yields: {e}"
        event(f"budget exceeded: {e.class_name}")
        return None


@GATE_SETTINGS
@given(case=pressured_cases())
def test_no_assembled_request_holds_an_unpaired_call_or_result(case: Case) -> None:
    r = build_or_fail_on_a_never_yield_class(case)
    if r is None:
        return
    for step in steps_of(r):
        event(f"yielded: {step}")
    assert pairs.orphans(r.request.messages) == []
    check_paired(r.request.messages)
    check_provider_bodies(r)
    # The active run is whole; retained history is whole units: every call in the request
    # has all of its results there (check_paired), and the items sent are the checkpoint's.
    s = split(case.cp)
    sent = {m.item_id for m in r.request.messages}
    for item in s.active:
        assert item.id in sent, f"active item {item.id} is missing"
    for m in r.request.messages:  # the pending pairs of the active loop never yield
        assert m.item_id not in s.pending or "[elided]" not in m.text, \
            f"pending result {m.item_id} became a pointer"
    retained = [i for i in s.carried if i.id in sent]
    assert retained == list(s.carried[len(s.carried) - len(retained):]), \
        "retained history is not a suffix"


# --------------------------------------------------------------------------- each yield path

RUNGS = ("knowledge", "recall", "tool_results", "history")


def _batch(k: int, seq: int, run: str, content: str, *,
           interleaved: bool = False) -> list[ConversationItem]:
    """A parallel batch of three calls, answered out of order. ``interleaved``: the third
    call is a second call item (``c<k>x``) issued before the first one's results, and its
    result comes last."""
    ids = (f"call_{k}a", f"call_{k}b", f"call_{k}c")
    if not interleaved:
        out: list[ConversationItem] = [f.call(f"c{k}", seq, *ids, run=run)]
        order = tuple(reversed(ids))
    else:
        out = [f.call(f"c{k}", seq, *ids[:2], run=run), f.call(f"c{k}x", seq + 1, ids[2], run=run)]
        order = (ids[1], ids[0], ids[2])
    for j, cid in enumerate(order):
        out.append(f.result(f"r{k}{j}", seq + 1, cid, content + f" #{j}", run=run))
    return out


def _sized_words(target: int, cost: Callable[[str], int]) -> str:
    """The shortest ``words(n)`` text whose cost reaches ``target`` tokens."""
    lo, hi = 0, max(target, 1) * 2
    while lo < hi:
        mid = (lo + hi) // 2
        if cost(words(mid, 4)) >= target:
            hi = mid
        else:
            lo = mid + 1
    return words(lo, 4)


def synthetic_overflow(depth: int, *, knowledge: bool = True, recall: bool = True,
                       summary_through: int | None = None, recall_floor: int = 0) -> Case:
    """A deterministic 16k-window request whose overflow reaches exactly ``depth`` rungs of
    the ladder (0: fits; 4: the history is cut), with every class under its own cap so that
    only the ladder yields. The trailing user message is sized to put the body where wanted:
    inside the knowledge passages' cost, then the recall's, then the pointers' savings, then
    beyond them all. ``recall_floor`` is the policy's recall floor (the recall rung stops
    there)."""
    lp = loaded_for("gpt-4o", 16_000, 4_096)
    est = f.estimator(lp.plan.spec.model)
    ctx = RenderContext(session_key=lp.session_key)
    policy = BudgetPolicy(recall_floor_tokens=recall_floor)
    result_text = words(80, 1)  # ~250 tokens each: all stay under 25% of the body
    items: list[ConversationItem] = [f.user("u0", "first question", 1, run="run-0")]
    items += _batch(1, 2, "run-0", result_text, interleaved=True)
    items += [AssistantMessageItem(id="a0", sequence=4, run_id="run-0",
                                   item_trust=TrustLevel.USER, text=words(300, 2)),
              f.user("u1", "second question", 5, run="run-1")]
    items += _batch(2, 6, "run-1", result_text, interleaved=True)
    items += [AssistantMessageItem(id="a1", sequence=8, run_id="run-1",
                                   item_trust=TrustLevel.USER, text=words(200, 3)),
              f.user("u2", "third question", 9, run="run-2")]
    items += _batch(3, 10, "run-2", result_text)  # completed in the active run
    items += [AssistantMessageItem(id="a2", sequence=12, run_id="run-2",
                                   item_trust=TrustLevel.USER, text="checking more")]
    # the active loop's pending batch
    items += _batch(4, 13, "run-2", "fine", interleaved=True)
    passages = tuple(KnowledgePassage(id=f"k{j}", source="kb", text=words(250, j), rank=j,
                                      trust=TrustLevel.EXTERNAL_UNTRUSTED)
                     for j in range(3)) if knowledge else ()
    lines = tuple(MemoryLine(id=f"m{j}", text=words(165, j)) for j in range(3)) \
        if recall else ()
    summary = (HistorySummary(text="Earlier: greetings.", replaced_through_sequence=summary_through)
               if summary_through is not None else None)

    def case(trailing: str) -> Case:
        cp = f.checkpoint([*items, f.user("u9", trailing, 20, run="run-2")], run="run-2",
                          knowledge=passages, recall=lines, summary=summary)
        return Case(loaded=lp, cp=cp, policy=policy, factor=1.0)

    probe = case("hi").build()
    assert probe.pressure.steps == (), f"the synthetic request must fit: {probe.pressure}"
    budget = probe.budget.body_budget

    def cost(item: ContextItem) -> int:
        return est.messages(item.messages(ctx))  # type: ignore[attr-defined]

    k_cost = cost(KnowledgeItem(passages=passages)) if passages else 0
    kept = list(lines)
    while kept and cost(RecallItem(lines=tuple(kept))) > recall_floor:
        kept.pop()
    r_cost = ((cost(RecallItem(lines=lines)) if lines else 0)
              - (cost(RecallItem(lines=tuple(kept))) if kept else 0))
    s = split(case("hi").cp)
    savings = sum(cost(i) - cost(replace(i, elided=True))
                  for i in (*s.carried[s.floor:], *s.active)
                  if isinstance(i, ToolResultItem) and i.id not in s.pending)
    history = sum(cost(replace(i, elided=True) if isinstance(i, ToolResultItem) else i)
                  for i in s.carried[s.floor:])
    edges = [0, k_cost, k_cost + r_cost, k_cost + r_cost + savings,
             k_cost + r_cost + savings + history]
    # the middle of each rung: the history rung leaves about half of the history out
    over = -200 if depth == 0 else (edges[depth - 1] + edges[depth]) // 2
    hi_cost = cost(TrailingUserInput(message=f.user("u9", "hi", 20, run="run-2")))
    target = budget - probe.body_tokens + hi_cost + over
    trailing = _sized_words(target, lambda t: cost(TrailingUserInput(
        message=f.user("u9", t, 20, run="run-2"))))
    return case(trailing)


PATHS = [(depth, k, r) for depth in range(5) for k, r in ((True, True), (False, False))
         if not (depth in (1, 2) and not k)]


@pytest.mark.parametrize(("depth", "knowledge", "recall"), PATHS)
def test_every_yield_path_keeps_pairs_whole(depth: int, knowledge: bool, recall: bool) -> None:
    r = synthetic_overflow(depth, knowledge=knowledge, recall=recall).build()
    ran = steps_of(r)
    rungs = [s for s in RUNGS[:depth] if (s != "knowledge" or knowledge)
             and (s != "recall" or recall)]
    assert list(ran) == rungs
    assert pairs.orphans(r.request.messages) == []
    check_paired(r.request.messages)
    check_provider_bodies(r)
    texts = {m.item_id: m.text for m in r.request.messages}
    for rid in ("r40", "r41", "r42"):  # the pending batch: whole, never a pointer
        assert rid in texts and "[elided]" not in texts[rid]


def test_a_result_that_arrived_before_a_later_call_item_of_its_batch_is_pending() -> None:
    """The active loop issued c1 (x1, x2) and, before x2's result, c2 (x3): one batch (the model
    is never called while x2 is open), so r1, which arrived between them, is as unread as r3
    and r2 and never yields. (Observed on an earlier tree: only the results after the last
    call item counted as pending, and r1 became a pointer under the 25% tool-result cap.)"""
    lp = loaded_for("gpt-4o", 16_000, 4_096)
    items: list[ConversationItem] = [
        f.user("u0", "old question", 1, run="run-0"), f.call("c0", 2, "x0", run="run-0"),
        f.result("r0", 3, "x0", words(300, 1), run="run-0"),
        f.user("u1", "now", 4, run="run-1"), f.call("c1", 5, "x1", "x2", run="run-1"),
        f.result("r1", 6, "x1", words(2_000, 2), run="run-1"),
        f.call("c2", 7, "x3", run="run-1"), f.result("r3", 8, "x3", words(100, 3), run="run-1"),
        f.result("r2", 8, "x2", "ok", run="run-1")]
    case = Case(loaded=lp, cp=f.checkpoint(items, run="run-1"), policy=BudgetPolicy(),
                factor=1.0)
    assert split(case.cp).pending == {"r1", "r2", "r3"}
    r = case.build()
    pointers = [i for s in r.pressure.steps if s.step == "tool_results" for i in s.ids]
    assert pointers == ["r0"]  # the class cap still yields, but only the completed result
    texts = {m.item_id: m.text for m in r.request.messages}
    assert "[elided]" in texts["r0"]
    assert all("[elided]" not in texts[i] for i in ("r1", "r2", "r3"))
    check_paired(r.request.messages)
    check_provider_bodies(r)
    # Answered in turn, c1 and c2 are two batches: only c2's result is pending.
    sequential = [*items[:5], f.result("r2", 6, "x2", "ok", run="run-1"), *items[5:8]]
    assert split(f.checkpoint(sequential, run="run-1")).pending == {"r3"}


def test_a_summary_floor_inside_a_parallel_batch_leaves_the_whole_batch_out() -> None:
    # The batch c1, c1x spans sequences 2-3; the floor 2 covers the first call item but not
    # the second nor any result.
    for depth in (0, 4):
        r = synthetic_overflow(depth, summary_through=2).build()
        sent = [m.item_id for m in r.request.messages]
        for item_id in ("u0", "c1", "c1x", "r10", "r11", "r12"):
            assert item_id not in sent
        check_paired(r.request.messages)
        check_provider_bodies(r)
        assert pairs.orphans(r.request.messages) == []


def test_a_bedrock_body_needs_the_tools_its_calls_use() -> None:
    """Bedrock refuses toolUse and toolResult blocks in a request without toolConfig, so the
    renderer refuses such a request (a field violation, never a body Bedrock would refuse);
    with the tools defined the same request renders."""
    r = synthetic_overflow(0).build()
    assert not r.request.tools and any(m.tool_calls for m in r.request.messages)
    with pytest.raises(InvalidInput, match="defines tools"):
        providers.render(r, "bedrock_converse")
    body = providers.render(with_called_tools(r), "bedrock_converse")
    assert tool_pairs.bedrock_problems(body) == []


def test_an_anthropic_body_needs_the_tools_its_calls_use() -> None:
    """Anthropic answers 400 "Requests which include `tool_use` or `tool_result` blocks must
    define tools." to a body whose history holds calls and whose plan pins no tools (an email
    session's): refused as Bedrock's is, and rendered once the tools are defined."""
    r = synthetic_overflow(0).build()
    assert not r.request.tools and any(m.tool_calls for m in r.request.messages)
    with pytest.raises(InvalidInput, match="defines tools"):
        providers.render(r, "anthropic_messages")
    body = providers.render(with_called_tools(r), "anthropic_messages")
    assert body["tools"] and providers.validate(body, "anthropic_messages") == []
    # the formats whose APIs take a tool-bearing history without tools still render it
    for fmt in ("openai_responses", "openai_chat_completions", "gemini_generate_content"):
        providers.render(r, fmt)


def test_the_envelope_check_notices_a_body_that_changes_an_envelope() -> None:
    r = synthetic_overflow(0).build()
    bodies = check_provider_bodies(r)
    body = json.loads(json.dumps(bodies["gemini_generate_content"]))
    part = next(p for c in body["contents"] for p in c["parts"] if "functionResponse" in p)
    text = part["functionResponse"]["response"]["output"]
    for changed in (text.replace("\n", "\n\n", 1),  # a body changed
                    text.replace("nonce=", "nonce =", 1),  # an opening no longer parses
                    text + text):  # repeated
        part["functionResponse"]["response"]["output"] = changed
        with pytest.raises(AssertionError):  # the parser's own error, or a difference
            check_envelopes(r, {"gemini_generate_content": body})


# --------------------------------------------------------------------------- orphan sweep

SWEEP_WINDOWS = (16_000, 20_000, 24_000, 32_000, 48_000, 64_000, 128_000, 200_000, 1_000_000)


def sweep_case(model_id: str, window: int, summary_through: int | None) -> Case:
    """Eight runs, each a parallel batch (every other one interleaved: a second call item
    before the first one's results; results out of order) with results and a message sized to
    the window, and the active run's own batch still pending: the ladder turns results into
    pointers and, up to 128k, cuts the history at unit boundaries wherever the window puts
    them; at 1M nothing yields."""
    reserve = 4_096 if window < 32_000 else None
    lp = loaded_for(model_id, window, reserve)
    content_words = min(window // 40, 3_000)
    items: list[ConversationItem] = []
    seq = 1
    for k in range(8):
        run = f"run-{k}"
        items.append(f.user(f"u{k}", f"question {k}", seq, run=run))
        items += _batch(k, seq + 1, run, words(content_words, k), interleaved=k % 2 == 0)
        items.append(AssistantMessageItem(id=f"a{k}", sequence=seq + 3, run_id=run,
                                          item_trust=TrustLevel.USER,
                                          text=words(content_words * 2, k)))
        seq += 4
    items.append(f.user("u8", "and now?", seq, run="run-8"))
    items += _batch(9, seq + 1, "run-8", "pending", interleaved=True)
    summary = (HistorySummary(text="Earlier: pages.", replaced_through_sequence=summary_through)
               if summary_through is not None else None)
    cp = f.checkpoint(items, run="run-8", summary=summary)
    return Case(loaded=lp, cp=cp, policy=BudgetPolicy(), factor=1.0)


@pytest.mark.parametrize("window", SWEEP_WINDOWS)
def test_the_orphan_sweep_across_windows_finds_no_orphan_in_any_format(window: int) -> None:
    """Every window from 16k to 1M, two models, no summary and summary floors that fall on a
    pair's call item, between runs and deep in the history: the request and all five bodies
    keep every pair (and every envelope)."""
    cut_somewhere = False
    for model_id in MODEL_IDS:
        for floor in (None, 2, 9, 18):
            case = sweep_case(model_id, window, floor)
            r = case.build()
            assert pairs.orphans(r.request.messages) == []
            check_paired(r.request.messages)
            check_provider_bodies(r)
            cut_somewhere |= "history" in steps_of(r)
    if window <= 128_000:
        assert cut_somewhere, "the sweep must reach the history cut up to 128k"


# --------------------------------------------------------------------------- the validator

def _req(*messages: Message) -> ModelRequest:
    return ModelRequest(prefix_blocks=(), tools=(), messages=messages)


def _calls(*ids: str) -> Message:
    return Message(row=10, role=Role.ASSISTANT, trust=TrustLevel.USER, item_id="c",
                   tool_calls=tuple(ToolCall(call_id=i, name="web.fetch",
                                             arguments_json="{}") for i in ids))


def _result_msg(call_id: str) -> Message:
    return Message(row=10, role=Role.TOOL, trust=TrustLevel.EXTERNAL_UNTRUSTED,
                   item_id=f"r-{call_id}", call_id=call_id, text="data")


_USER = Message(row=15, role=Role.USER, trust=TrustLevel.USER, item_id="u", text="hi")

ORPHANS = {
    "call without a result": _req(_calls("a", "b"), _result_msg("a"), _USER),
    "result without a call": _req(_result_msg("z"), _USER),
    "result before its call": _req(_result_msg("a"), _calls("a"), _USER),
    "call answered twice": _req(_calls("a"), _result_msg("a"), _result_msg("a"), _USER),
    "call id made twice": _req(_calls("a"), _result_msg("a"), _calls("a"), _result_msg("a")),
    "only a result left of a parallel batch": _req(_result_msg("b"), _USER),
}


@pytest.mark.parametrize("kind", sorted(ORPHANS))
def test_the_validator_rejects_a_hand_built_request_with_an_orphan(kind: str) -> None:
    request = ORPHANS[kind]
    assert pairs.orphans(request.messages) != []
    with pytest.raises(AssertionError):
        check_paired(request.messages)  # the independent check agrees
    with pytest.raises(AssemblyError, match="unpaired"):
        assert_paired(request)


def test_the_validator_accepts_a_well_formed_request() -> None:
    request = _req(_calls("a", "b"), _result_msg("b"), _result_msg("a"), _USER)
    assert pairs.orphans(request.messages) == []
    check_paired(request.messages)
    assert_paired(request)
