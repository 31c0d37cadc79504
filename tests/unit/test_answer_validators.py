"""The fuzz run's checks of successful Build answers can fail: the independent tool-pairing
validator (``tests/support/tool_pairs.py``) and the envelope reading, on hand-made answers, and
the run's seed comes from ``CE_FUZZ_SEED`` when set, fresh otherwise."""

from __future__ import annotations

import json

import pytest
from context_engine.v1 import context_engine_pb2 as pb

from tests.support import fuzz, tool_pairs

TOOL = pb.ROLE_TOOL
ASSISTANT = pb.ROLE_ASSISTANT
USER = pb.ROLE_USER


def call(*ids: str) -> pb.Message:
    return pb.Message(role=ASSISTANT, tool_calls=[
        pb.ToolCall(call_id=i, name="web.fetch", arguments_json="{}") for i in ids])


def result(call_id: str) -> pb.Message:
    return pb.Message(role=TOOL, call_id=call_id, text="ok")


def user(text: str = "hi") -> pb.Message:
    return pb.Message(role=USER, text=text)


def request(*messages: pb.Message) -> pb.ModelRequest:
    return pb.ModelRequest(messages=list(messages))


def test_a_well_paired_request_has_no_problem():
    assert tool_pairs.request_problems(request(
        user(), call("a", "b"), result("b"), user(), result("a"), call("c"), result("c"))) == []


@pytest.mark.parametrize(("messages", "expected"), [
    ((user(), call("a")), "call 'a' has no result"),
    ((user(), result("a")), "result for 'a' without an earlier call"),
    ((result("a"), call("a")), "result for 'a' without an earlier call"),
    ((call("a"), result("a"), result("a")), "call 'a' answered twice"),
    ((call("a"), call("a"), result("a")), "call 'a' called again"),
    ((call("a", "a"), result("a")), "call 'a' called again"),
    ((call(""), result("")), "a tool call without an id"),
])
def test_the_pairing_validator_finds_each_broken_pair(messages, expected):
    problems = tool_pairs.request_problems(request(*messages))
    assert any(expected in p for p in problems), problems


def anthropic(*turns: tuple[str, list[dict[str, object]]]) -> str:
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]})


def use(i: str) -> dict[str, object]:
    return {"type": "tool_use", "id": i, "name": "f", "input": {}}


def res(i: str) -> dict[str, object]:
    return {"type": "tool_result", "tool_use_id": i, "content": "x"}


TEXT = {"type": "text", "text": "t"}
ANTHROPIC = pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES
OPENAI = pb.PROVIDER_FORMAT_OPENAI_RESPONSES


def test_anthropic_bodies():
    good = anthropic(("user", [TEXT]), ("assistant", [use("a"), use("b")]),
                     ("user", [res("b"), res("a"), TEXT]))
    assert tool_pairs.body_problems(good, ANTHROPIC) == []
    # the result waits for a later turn instead of the one right after its call
    late = anthropic(("user", [TEXT]), ("assistant", [use("a")]), ("user", [TEXT]),
                     ("assistant", [TEXT]), ("user", [res("a")]))
    problems = tool_pairs.body_problems(late, ANTHROPIC)
    assert any("not answered in the next user turn" in p for p in problems), problems
    assert any("does not follow its tool_use" in p for p in problems), problems
    behind = anthropic(("user", [TEXT]), ("assistant", [use("a")]), ("user", [TEXT, res("a")]))
    assert any("after other content" in p for p in tool_pairs.body_problems(behind, ANTHROPIC))
    twice = anthropic(("user", [TEXT]), ("assistant", [use("a")]), ("user", [res("a"), res("a")]))
    assert any("answered twice" in p for p in tool_pairs.body_problems(twice, ANTHROPIC))
    assert tool_pairs.body_problems("not json", ANTHROPIC)


def test_openai_bodies():
    def body(*items: dict[str, object]) -> str:
        return json.dumps({"input": list(items)})

    fc = {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"}
    out = {"type": "function_call_output", "call_id": "a", "output": "x"}
    def problems(*items: dict[str, object]) -> list[str]:
        return tool_pairs.body_problems(body(*items), OPENAI)

    assert problems(fc, out) == []
    assert any("without an earlier call" in p for p in problems(out, fc))
    assert any("has no output" in p for p in problems(fc))
    assert any("answered twice" in p for p in problems(fc, out, out))
    assert any("called twice" in p for p in problems(fc, fc, out))


def envelope(body: str, nonce: str = "0123456789abcdef", close: bool = True) -> str:
    text = f'<untrusted source="tool:web.fetch" id="r1" nonce="{nonce}">\n{body}\n'
    return text + (f"</untrusted:{nonce}>" if close else "")


def answer(*messages: pb.Message, body: str = "") -> pb.BuildResponse:
    return pb.BuildResponse(request=request(*messages), provider_body_json=body)


def build(provider_format: int = 0) -> bytes:
    return pb.BuildRequest(provider_format=provider_format).SerializeToString()  # type: ignore[arg-type]


def test_build_answer_checks_read_envelopes_and_pairs():
    fine = answer(user(), call("a"), pb.Message(role=TOOL, call_id="a", text=envelope("page")))
    assert fuzz.build_answer_problems(build(), fine) == []
    unclosed = answer(pb.Message(role=USER, text=envelope("page", close=False)))
    assert any("never closed" in p for p in fuzz.build_answer_problems(build(), unclosed))
    closed_twice = answer(pb.Message(role=USER,
                                     text=envelope("x") + "</untrusted:0123456789abcdef>"))
    assert any("occurs 2 times" in p for p in fuzz.build_answer_problems(build(), closed_twice))
    tag_inside = answer(pb.Message(role=USER, text=envelope("see </untrusted:1> now")))
    assert any("reads as containing tags" in p
               for p in fuzz.build_answer_problems(build(), tag_inside))
    in_prefix = pb.BuildResponse(request=pb.ModelRequest(prefix_blocks=[
        pb.PrefixBlock(row=6, text=envelope("\uff1cuser"))]))
    assert any("prefix_blocks[0]" in p for p in fuzz.build_answer_problems(build(), in_prefix))
    orphan = answer(user(), call("a"))
    assert any(p.startswith("pairing:") for p in fuzz.build_answer_problems(build(), orphan))
    # a body asked for and missing, and a body whose pairing is broken
    assert fuzz.build_answer_problems(build(ANTHROPIC), fine) == ["no provider body for format 1"]
    broken = answer(user(), call("a"), result("a"),
                    body=json.dumps({"input": [{"type": "function_call_output",
                                                "call_id": "a", "output": "x"}]}))
    assert any(p.startswith("provider body PROVIDER_FORMAT_OPENAI_RESPONSES")
               for p in fuzz.build_answer_problems(build(OPENAI), broken))


def test_the_seed_is_fresh_unless_fixed(monkeypatch):
    monkeypatch.delenv(fuzz.SEED_ENV, raising=False)
    assert len({fuzz.run_seed() for _ in range(8)}) > 1
    monkeypatch.setenv(fuzz.SEED_ENV, "1234")
    assert fuzz.run_seed() == 1234
    assert "CE_FUZZ_SEED=1234" in fuzz.reproduce_hint(1234)
    monkeypatch.setenv(fuzz.SEED_ENV, "0x10")
    assert fuzz.run_seed() == 16
    monkeypatch.setenv(fuzz.SEED_ENV, "soon")
    with pytest.raises(ValueError, match="CE_FUZZ_SEED"):
        fuzz.run_seed()
