"""A prefix block of white space alone: agent instructions such as " " (row 3), which ``Plan``
refuses now (``agent.instructions``) and a plan stored before that refusal still pins. Claude's
bodies (Anthropic Messages, Bedrock Converse) leave the block out of ``system`` and put
``after_system`` on the last cacheable system block; the formats that join the prefix into one
text keep it; both Claude validators refuse a system block of white space only. Through the
real server and PostgreSQL: tests/integration/test_blank_instructions.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from context_engine.api import mapping
from context_engine.domain import providers as p
from context_engine.domain.builder import BuildResult
from context_engine.domain.errors import InvalidInput
from context_engine.domain.model import Persona, PersonaEntry
from context_engine.domain.provider_common import Turns, marked_blocks
from context_engine.v1 import context_engine_pb2 as pb

from tests import factories as f
from tests.unit.test_providers import CATALOG, two_runs

CLAUDE = "claude-sonnet-4-5"
BEDROCK = "us.anthropic.claude-sonnet-4-5-20250929-v1:0"
BLANKS = [" ", "\n", "\t \n", "\u3000"]
PERSONA = Persona(revision="r1", entries=(PersonaEntry(key="tone", text="Brief."),))


def blank_plan_build(instructions: str = " ", *, model_id: str = CLAUDE,
                     persona: Persona | None = None) -> BuildResult:
    """A Build of a plan pinning ``instructions`` (as one stored before Plan refused them):
    no index, skills or snapshot, so row 3 ends the prefix unless a persona follows it."""
    i = f.inputs(instructions=instructions, enabled=tuple(t.name for t in CATALOG),
                 catalog=CATALOG, model_profile=f.model(model_id), persona=persona)
    return f.run_build(f.loaded(i), f.checkpoint(two_runs()))


def system_texts(body: dict[str, Any]) -> list[str]:
    return [b["text"] for b in body.get("system", []) if "text" in b]


# ----------------------------------------------------------------------------- Plan

@pytest.mark.parametrize("blank", BLANKS)
def test_plan_refuses_instructions_of_white_space_alone(blank: str) -> None:
    req = pb.PlanRequest(tenant_id="t", session_id="s", agent=pb.AgentSpec(
        agent_id="a", version="1", instructions=blank), model=pb.ModelSpec(model_id=CLAUDE))
    with pytest.raises(InvalidInput) as refused:
        mapping.plan_command(req)
    assert [(v.field, v.description) for v in refused.value.violations] == [
        ("agent.instructions", "is white space alone: send it empty for no instructions")]


@pytest.mark.parametrize("instructions", ["", " Cite sources. ", "\nBe brief."])
def test_plan_takes_empty_instructions_and_text_around_white_space(instructions: str) -> None:
    req = pb.PlanRequest(tenant_id="t", session_id="s", agent=pb.AgentSpec(
        agent_id="a", version="1", instructions=instructions),
        model=pb.ModelSpec(model_id=CLAUDE))
    assert mapping.plan_command(req).agent.instructions == instructions


def test_empty_instructions_render_no_block() -> None:
    r = blank_plan_build("")
    assert 3 not in [b.row for b in r.request.prefix_blocks]


# ----------------------------------------------------------------------------- the marker

def test_after_system_skips_a_trailing_system_block_that_is_not_cacheable() -> None:
    r = blank_plan_build()
    assert "after_system" in [m.name for m in r.cache_breakpoints]
    system = [{"type": "text", "text": "Policy."}, {"type": "text", "text": "Framing."},
              {"type": "text", "text": " "}]
    marks = marked_blocks(r, tools=[], system=system, turns=Turns(model_role="assistant"),
                          cacheable=p._cacheable)
    assert [block for block, _ in marks] == [system[1]]
    nothing = [{"type": "text", "text": "\n"}]
    assert marked_blocks(r, tools=[], system=nothing, turns=Turns(model_role="assistant"),
                         cacheable=p._cacheable) == []


# ----------------------------------------------------------------------------- Claude bodies

@pytest.mark.parametrize("blank", BLANKS)
def test_anthropic_leaves_a_blank_last_block_out_and_marks_the_one_before(blank: str) -> None:
    r = blank_plan_build(blank)
    blocks = r.request.prefix_blocks
    assert (blocks[-1].row, blocks[-1].text) == (3, blank)  # the pinned bytes are as they were
    body = p.render(r, p.ANTHROPIC_MESSAGES)
    assert system_texts(body) == [b.text for b in blocks[:-1]]
    assert "cache_control" in body["system"][-1]
    assert [b for b in body["system"] if "cache_control" in b] == [body["system"][-1]]
    assert p.validate_anthropic(body) == []
    assert json.dumps(p.render(r, p.ANTHROPIC_MESSAGES)) == json.dumps(body)


@pytest.mark.parametrize("blank", BLANKS)
def test_bedrock_leaves_a_blank_last_block_out_and_points_after_the_one_before(
        blank: str) -> None:
    r = blank_plan_build(blank, model_id=BEDROCK)
    blocks = r.request.prefix_blocks
    assert (blocks[-1].row, blocks[-1].text) == (3, blank)
    body = p.render(r, p.BEDROCK_CONVERSE)
    assert system_texts(body) == [b.text for b in blocks[:-1]]
    assert "cachePoint" in body["system"][-1] and "text" in body["system"][-2]
    assert p.validate_bedrock(body) == []
    assert json.dumps(p.render(r, p.BEDROCK_CONVERSE)) == json.dumps(body)


@pytest.mark.parametrize("fmt", [p.ANTHROPIC_MESSAGES, p.BEDROCK_CONVERSE])
def test_claude_bodies_leave_a_blank_block_out_mid_prefix(fmt: str) -> None:
    r = blank_plan_build(persona=PERSONA, model_id=CLAUDE if "anthropic" in fmt else BEDROCK)
    rows = [b.row for b in r.request.prefix_blocks]
    assert rows[-2:] == [3, 4]
    body = p.render(r, fmt)
    sent = system_texts(body)
    assert sent == [b.text for b in r.request.prefix_blocks if b.row != 3]
    assert sent[-1].startswith("Persona")


@pytest.mark.parametrize("fmt", [p.OPENAI_RESPONSES, p.OPENAI_CHAT_COMPLETIONS,
                                 p.GEMINI_GENERATE_CONTENT])
def test_joined_formats_keep_the_blank_block_in_their_one_text(fmt: str) -> None:
    r = blank_plan_build()
    body = p.render(r, fmt)  # valid: the text around it is never blank
    text = {p.OPENAI_RESPONSES: lambda: body["instructions"],
            p.OPENAI_CHAT_COMPLETIONS: lambda: body["messages"][0]["content"],
            p.GEMINI_GENERATE_CONTENT: lambda: body["systemInstruction"]["parts"][0]["text"],
            }[fmt]()
    assert text == "\n\n".join(b.text for b in r.request.prefix_blocks)
    assert text.endswith("\n\n ")  # the bytes these bodies always sent
    assert json.dumps(p.render(r, fmt)) == json.dumps(body)


# ----------------------------------------------------------------------------- validators

@pytest.mark.parametrize("blank", BLANKS)
def test_the_anthropic_validator_refuses_a_system_block_of_white_space(blank: str) -> None:
    body = p.render(blank_plan_build("Cite sources."), p.ANTHROPIC_MESSAGES)
    body["system"].insert(1, {"type": "text", "text": blank})
    assert p.validate_anthropic(body) == [
        "system[1]: text blocks must hold more than white space"]
    body["system"] = blank
    assert p.validate_anthropic(body) == [
        "system[0]: text blocks must hold more than white space"]


@pytest.mark.parametrize("blank", BLANKS)
def test_the_bedrock_validator_refuses_a_system_block_of_white_space(blank: str) -> None:
    body = p.render(blank_plan_build("Cite sources.", model_id=BEDROCK), p.BEDROCK_CONVERSE)
    body["system"].insert(1, {"text": blank})
    assert p.validate_bedrock(body) == [
        "system[1]: must be a text block holding more than white space, or a cachePoint"]
