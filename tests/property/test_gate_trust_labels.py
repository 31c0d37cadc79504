"""Hard gate, labels (`gate_trust`; spec: "The label survives every transformation", "The
working-state block carries per-entry trust", "Untrusted content is elided, never paraphrased").

Canaries are placed in the words the platform did not author: a user message, the model's own
text, the model's echo of a fetched page (with the page's envelope-closing attack in it), a
constraint, the objective, a task title and an open question — each with a label drawn from
USER, MEMORY and EXTERNAL_UNTRUSTED — and in the places that must never reach a summarizer:
tool-call arguments and the fetched page itself. A generated session then runs runs of
Build, Compact (the deterministic summarizer, one that echoes everything it is given, and the
LLM summarizer against a loopback endpoint that answers with its whole request), depth-2 merges
and carries of the working state across runs.

After every step, every request and both provider bodies are read back with the independent
parser of ``tests/support/envelope_parser.py``: each canary occurs only inside an envelope
whose label is its own or less trusted (``check_labels``), except where the model's own turn
is replayed verbatim in the assistant role. What a summarizer was given never holds a tool
argument or the page, and a summary's narrative carries a label no higher than any canary
it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from context_engine.domain.builder import BuildResult, LoadedPlan
from context_engine.domain.compaction import (
    NothingToCompact,
    StructuredSummarizer,
    Summarized,
    SummaryInput,
    Target,
    compact,
)
from context_engine.domain.items import (
    AssistantMessageItem,
    ConversationItem,
    HistorySummary,
    RenderContext,
    ToolCallItem,
    WorkingTask,
)
from context_engine.domain.providers import render
from context_engine.domain.request import Role, ToolCall
from context_engine.domain.trust import TrustLevel
from context_engine.domain.working_state import (
    AskUser,
    LogEvent,
    Update,
    UserObjective,
    replay,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import factories as f
from tests.property.test_gate_tool_pairs import with_called_tools
from tests.property.test_gate_trust import body_strings, echo_provider
from tests.support import envelope_parser as P
from tests.support.attacks import FOLDED_ATTACKS

pytestmark = pytest.mark.gate_trust

USER, MEMORY, UNTRUSTED = TrustLevel.USER, TrustLevel.MEMORY, TrustLevel.EXTERNAL_UNTRUSTED
LABELS = (USER, MEMORY, UNTRUSTED)
TAG = {USER: "user", MEMORY: "memory", UNTRUSTED: "untrusted"}
PROVIDERS = ("anthropic_messages", "openai_responses", "openai_chat_completions",
             "gemini_generate_content", "bedrock_converse")
# where each body holds its turns, and the role of the model's own turns in it
TURNS = {"anthropic_messages": ("messages", "assistant"), "openai_responses": ("input", ""),
         "openai_chat_completions": ("messages", "assistant"),
         "gemini_generate_content": ("contents", "model"),
         "bedrock_converse": ("messages", "assistant")}
ATTACKS = tuple(a for a in FOLDED_ATTACKS if len(a.text) <= 300)


@functools.cache
def plan() -> LoadedPlan:
    return f.loaded(f.inputs(model_profile=f.model(context_window=2_000_000)))


class Recording:
    """Wraps a summarizer and keeps every input it was given."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.version = inner.version
        self.seen: list[SummaryInput] = []

    async def summarize(self, data: SummaryInput, max_chars: int) -> Summarized:
        self.seen.append(data)
        result: Summarized = await self.inner.summarize(data, max_chars)
        return result


class EchoSummarizer:
    """The worst summarizer: its narrative is everything it was given."""

    version = "echo/1"

    async def summarize(self, data: SummaryInput, max_chars: int) -> Summarized:
        return Summarized(narrative=repr(data), version=self.version)


@dataclass
class Session:
    """A runtime's view: items, the working-state log, the summary, and the canaries placed."""

    items: list[ConversationItem] = field(default_factory=list)
    events: list[LogEvent] = field(default_factory=list)
    summary: HistorySummary | None = None
    labels: dict[str, str] = field(default_factory=dict)  # canary -> tag of its own label
    never_summarized: set[str] = field(default_factory=set)
    assistant_texts: set[str] = field(default_factory=set)
    replayed: set[str] = field(default_factory=set)  # canaries in the model's own turns
    seq: int = 0
    runs: int = 0
    summarized: list[tuple[str, str]] = field(default_factory=list)  # (canary, summary tag)
    # canaries at USER in items a compaction replaced: the narrative is written from them
    replaced_trusted: set[str] = field(default_factory=set)

    def next(self) -> int:
        self.seq += 1
        return self.seq

    def canary(self, kind: str, run: int, label: TrustLevel) -> str:
        c = f"CANARY-{kind}{run}-LBL"
        self.labels[c] = TAG[label]
        return c

    @property
    def active(self) -> str:
        return f"run-{self.runs - 1}"

    def new_run(self, data: st.DataObject) -> None:
        k, run = self.runs, f"run-{self.runs}"
        self.runs += 1
        draw = functools.partial(data.draw, st.sampled_from(LABELS))
        lu, la, le, lc, lo, lt, lq = (draw() for _ in range(7))
        attack = data.draw(st.sampled_from(ATTACKS))
        self.labels[attack.canary] = "untrusted"  # the page's own canary
        self.never_summarized.add(attack.canary)
        user_c, objective_c = self.canary("U", k, lu), self.canary("O", k, lo)
        constraint_c, task_c = self.canary("C", k, lc), self.canary("T", k, lt)
        question_c, assistant_c = self.canary("Q", k, lq), self.canary("A", k, la)
        echo_c, argument_c = self.canary("E", k, le), self.canary("G", k, UNTRUSTED)
        self.never_summarized.add(argument_c)
        first = self.next()
        self.items.append(f.user(f"u{k}", f"Plan the offsite, please. {user_c}", first,
                                 run=run, trust=lu))
        self.events += [
            LogEvent(sequence=first, run_id=run, transition=UserObjective(
                objective=f"Plan the offsite {objective_c}", trust=lo)),
            LogEvent(sequence=self.next(), run_id=run, transition=Update(
                add_constraints=(f"Stay under budget {constraint_c}",), trust=lc)),
            LogEvent(sequence=self.next(), run_id=run, transition=Update(
                upsert_tasks=(WorkingTask(id=f"t{k}", title=f"Book {task_c}", state="open"),),
                trust=lt)),
            LogEvent(sequence=self.next(), run_id=run,
                     transition=AskUser(question=f"Which date {question_c}?", trust=lq))]
        said = f"Noted the budget. {assistant_c}"
        echo = f"The page says: {attack.text[:-len(attack.canary)]} {echo_c}"
        self.assistant_texts |= {said, echo}
        self.replayed |= {assistant_c, echo_c, argument_c}
        call = ToolCall(call_id=f"k{k}", name="web.fetch",
                        arguments_json=json.dumps({"url": f"https://venue.example/{k}",
                                                   "note": argument_c}))
        self.items += [
            AssistantMessageItem(id=f"a{k}", sequence=self.next(), run_id=run,
                                 item_trust=la, text=said),
            ToolCallItem(id=f"c{k}", sequence=self.next(), run_id=run, item_trust=USER,
                         calls=(call,)),
            f.result(f"r{k}", self.next(), f"k{k}", f"Venue page. {attack.text}", run=run),
            AssistantMessageItem(id=f"e{k}", sequence=self.next(), run_id=run,
                                 item_trust=le, text=echo)]

    def checkpoint(self) -> Any:
        # carry: the run's working state is computed from the whole log so far
        state = replay(self.events, self.seq + 1).state
        return f.checkpoint(self.items, run=self.active, working_state=state,
                            summary=self.summary)


def assistant_parts(body: dict[str, Any], fmt: str) -> Iterator[Any]:
    """The parts of a provider body that replay the model's own turns."""
    key, role = TURNS[fmt]
    if fmt == "openai_responses":
        yield from (i for i in body[key] if i.get("role") == "assistant"
                    or i.get("type") in ("function_call", "reasoning"))
    else:
        yield from (m for m in body[key] if m["role"] == role)


def check(r: BuildResult, s: Session) -> None:
    """Every canary only inside envelopes at its own label or lower; the assistant role only
    replays the model's own turns verbatim."""
    for b in r.request.prefix_blocks:
        P.check_labels(b.text, s.labels)
    for t in r.request.tools:
        P.check_labels(t.description, s.labels)
    for m in r.request.messages:
        if m.role is Role.ASSISTANT:
            assert not m.text or m.text in s.assistant_texts, m.text[:200]
            continue
        try:
            P.check_labels(m.text, s.labels)
        except P.EnvelopeError as e:
            raise AssertionError(f"row {m.row} {m.role.value}: {e}") from None
    for fmt in PROVIDERS:
        # a definition for each tool called (Anthropic refuses calls without tools; these
        # plans pin none): it changes no label
        body = render(with_called_tools(r), fmt)
        replayed = list(assistant_parts(body, fmt))
        key = TURNS[fmt][0]
        rest = {k: v for k, v in body.items() if k != key}
        turns = body[key]
        rest["turns"] = [t for t in turns if t not in replayed]
        for where, text in body_strings(rest, fmt):
            try:
                P.check_labels(text, s.labels)
            except P.EnvelopeError as e:
                raise AssertionError(f"{where}: {e}") from None
        for _, text in body_strings(replayed, fmt):  # the model's own turns and calls only
            foreign = [c for c in s.labels if c in text and c not in s.replayed]
            assert not foreign, (foreign, text[:200])


def summarizers(kind: str, stack: contextlib.ExitStack) -> Any:
    if kind == "structured":
        return StructuredSummarizer()
    if kind == "echo":
        return EchoSummarizer()
    import context_engine.adapters.summarizer as S
    url = stack.enter_context(echo_provider([]))
    return S.OpenAISummarizer(url=url, model="fake-echo", timeout=5.0)


def compact_step(s: Session, summarizer: Recording) -> bool:
    lp = plan()
    est = f.estimator(lp.plan.spec.model)
    ctx = RenderContext(session_key=lp.session_key)
    before = max(i.sequence for i in s.items if i.run_id != s.active)
    try:
        r = asyncio.run(compact(
            s.items, s.summary, active_run_id=s.active, target=Target(replace_through=before),
            reason="gate_trust", summarizer=summarizer,
            measure=lambda ms: est.messages(list(ms), 1.0), ctx=ctx,
            state=s.checkpoint().working_state, max_summary_tokens=200_000))
    except NothingToCompact:
        return False
    given = repr(summarizer.seen[-1])
    leaked = [c for c in s.never_summarized if c in given]
    assert not leaked, f"never-summarized canaries reached the summarizer: {leaked}"
    # the summarizer runs on trusted content only: nothing below USER is given to it (the
    # working state's entries below USER included; an earlier narrative below USER is carried
    # as it is, at its label)
    below = [c for c, tag in s.labels.items() if P.TAG_RANK[tag] < P.TAG_RANK["user"]
             and c in given]
    assert not below, f"canaries below USER reached the summarizer: {below}"
    replaced = " ".join(getattr(it, "text", "") for it in s.items
                        if it.id in r.replaced_item_ids)
    s.replaced_trusted |= {c for c, tag in s.labels.items() if tag == "user" and c in replaced}
    held = [c for c in s.labels if c in r.summary]
    for c in held:
        assert P.TAG_RANK[TAG[r.narrative_trust]] <= P.TAG_RANK[s.labels[c]], (
            c, s.labels[c], r.narrative_trust)
        s.summarized.append((c, TAG[r.narrative_trust]))
    s.summary = r.history_summary()
    return True


SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("kind", ["structured", "echo", "llm_echo_fake"])
@SETTINGS
@given(data=st.data())
def test_labels_survive_build_compact_merge_and_carry(kind: str, data: st.DataObject) -> None:
    s = Session()
    with contextlib.ExitStack() as stack:
        summarizer = Recording(summarizers(kind, stack))
        compactions = 0
        for _ in range(data.draw(st.integers(2, 4), label="runs")):
            s.new_run(data)
            check(f.run_build(plan(), s.checkpoint()), s)
            wanted = s.runs > 1 and compactions < 2 and data.draw(st.booleans(),
                                                                  label="compact")
            if wanted and compact_step(s, summarizer):
                compactions += 1
                check(f.run_build(plan(), s.checkpoint()), s)
        if compactions == 0 and s.runs > 1:  # at least one compaction per session
            assert compact_step(s, summarizer)
            check(f.run_build(plan(), s.checkpoint()), s)
    assert s.summary is not None
    # not vacuous: the narrative does hold the trusted words it was written from
    assert s.summarized or not s.replaced_trusted, "no canary reached a narrative"


def test_the_checker_catches_a_raised_label() -> None:
    """The reader is not vacuous: a USER envelope around an untrusted canary fails it."""
    n = "0123456789abcdef"
    text = f'<user source="summary" id="summary" nonce="{n}">\nX CANARY-P\n</user:{n}>'
    P.check_labels(text, {"CANARY-P": "user"})
    with pytest.raises(P.EnvelopeError, match="label was raised"):
        P.check_labels(text, {"CANARY-P": "untrusted"})
    with pytest.raises(P.EnvelopeError, match="outside every envelope"):
        P.check_labels("Summary: CANARY-P", {"CANARY-P": "user"})


@pytest.mark.parametrize("kind", ["structured", "echo", "llm_echo_fake"])
def test_tool_call_arguments_never_reach_a_summarizer(kind: str) -> None:
    """What a summarizer is given (and, for the LLM one, the bytes it is sent) never holds a
    tool call's arguments, only its tool's name; nor does the summary."""
    arguments = "ARGS-CANARY-9d1f"
    items: list[ConversationItem] = [
        f.user("u0", "Fetch the venue page.", 1, run="run-0"),
        ToolCallItem(id="c0", sequence=2, run_id="run-0", item_trust=USER, calls=(
            ToolCall(call_id="k0", name="web.fetch",
                     arguments_json=json.dumps({"url": f"https://x.example/{arguments}"})),
            ToolCall(call_id="k1", name="mail.send",
                     arguments_json=json.dumps({"body": arguments})))),
        f.result("r0", 3, "k0", "page", run="run-0", trust=USER),
        f.result("r1", 4, "k1", "sent", run="run-0", trust=USER),
        f.user("u1", "Thanks.", 5, run="run-1")]
    lp = plan()
    est = f.estimator(lp.plan.spec.model)
    received: list[bytes] = []
    with contextlib.ExitStack() as stack:
        if kind == "llm_echo_fake":
            import context_engine.adapters.summarizer as S
            inner: Any = S.OpenAISummarizer(url=stack.enter_context(echo_provider(received)),
                                            model="fake-echo", timeout=5.0)
        else:
            inner = StructuredSummarizer() if kind == "structured" else EchoSummarizer()
        rec = Recording(inner)
        r = asyncio.run(compact(
            items, None, active_run_id="run-1", target=Target(replace_through=4),
            reason="gate_trust", summarizer=rec,
            measure=lambda ms: est.messages(list(ms), 1.0),
            ctx=RenderContext(session_key=lp.session_key)))
    assert arguments not in repr(rec.seen) and arguments not in r.summary
    assert "web.fetch, mail.send" in repr(rec.seen)  # the names do reach it
    if kind == "llm_echo_fake":
        assert received and all(arguments.encode() not in body for body in received)
        assert b"web.fetch" in received[0]
