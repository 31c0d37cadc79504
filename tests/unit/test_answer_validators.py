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


CHAT = pb.PROVIDER_FORMAT_OPENAI_CHAT_COMPLETIONS
GEMINI = pb.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT
BEDROCK = pb.PROVIDER_FORMAT_BEDROCK_CONVERSE


def test_chat_completions_bodies():
    def problems(*messages: dict[str, object]) -> list[str]:
        return tool_pairs.body_problems(json.dumps({"messages": list(messages)}), CHAT)

    def calls(*ids: str, content: str | None = None) -> dict[str, object]:
        return {"role": "assistant", "content": content, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}}
            for i in ids]}

    def tool(i: str) -> dict[str, object]:
        return {"role": "tool", "tool_call_id": i, "content": "x"}

    system = {"role": "system", "content": "Be brief."}
    hi = {"role": "user", "content": "hi"}
    assert problems(system, hi, calls("a", "b"), tool("b"), tool("a"), hi) == []
    # a user message between a call and its result: the API wants the results right after
    assert any("not all answered" in p for p in problems(hi, calls("a"), hi, tool("a")))
    assert any("not in the run of tool messages" in p
               for p in problems(hi, calls("a"), hi, tool("a")))
    assert any("have no tool message" in p for p in problems(hi, calls("a", "b"), tool("a")))
    assert any("without an earlier call" in p for p in problems(hi, tool("z")))
    assert any("answered twice" in p for p in problems(hi, calls("a"), tool("a"), tool("a")))
    assert any("used twice" in p
               for p in problems(hi, calls("a"), tool("a"), calls("a"), tool("a")))
    # an interleaved second call message before the first one's results
    assert problems(hi, calls("a"), calls("b"), tool("a"), tool("b"))
    assert any("after the conversation started" in p for p in problems(hi, system))
    assert any("neither content nor tool_calls" in p
               for p in problems(hi, {"role": "assistant", "content": ""}))


def test_gemini_bodies():
    def problems(*turns: tuple[str, list[dict[str, object]]]) -> list[str]:
        return tool_pairs.body_problems(json.dumps(
            {"contents": [{"role": r, "parts": p} for r, p in turns]}), GEMINI)

    def call(name: str, i: str | None = None) -> dict[str, object]:
        return {"functionCall": {"name": name, "args": {}, **({"id": i} if i else {})}}

    def answer(name: str, i: str | None = None) -> dict[str, object]:
        return {"functionResponse": {"name": name, "response": {"output": "x"},
                                     **({"id": i} if i else {})}}

    hi = {"text": "hi"}
    assert problems(("user", [hi]), ("model", [call("f", "a"), call("g", "b")]),
                    ("user", [answer("f", "a"), answer("g", "b"), hi])) == []
    assert problems(("user", [hi]), ("model", [call("f"), call("g")]),
                    ("user", [answer("f"), answer("g")])) == []  # no ids: by name, in order
    out_of_order = problems(("user", [hi]), ("model", [call("f", "a"), call("f", "b")]),
                            ("user", [answer("f", "b"), answer("f", "a")]))
    assert any("response 0 has id 'b', call 0 'a'" in p for p in out_of_order), out_of_order
    assert any("1 function responses for the 2 calls" in p for p in problems(
        ("user", [hi]), ("model", [call("f"), call("g")]), ("user", [answer("f")])))
    assert any("named 'g', call 0 'f'" in p for p in problems(
        ("user", [hi]), ("model", [call("f")]), ("user", [answer("g")])))
    assert any("not answered in the next turn" in p for p in problems(
        ("user", [hi]), ("model", [call("f")]), ("user", [hi])))
    assert any("do not follow a function call turn" in p for p in problems(
        ("user", [hi]), ("model", [hi]), ("user", [answer("f")])))
    assert any("two 'model' turns in a row" in p for p in problems(
        ("user", [hi]), ("model", [hi]), ("model", [hi])))
    assert any("the first turn must be the user's" in p for p in problems(("model", [hi])))
    assert any("functionCall in a 'user' turn" in p for p in problems(("user", [call("f")])))
    assert any("used twice" in p for p in problems(
        ("user", [hi]), ("model", [call("f", "a")]), ("user", [answer("f", "a")]),
        ("model", [call("f", "a")]), ("user", [answer("f", "a")])))


def test_bedrock_bodies():
    def problems(*turns: tuple[str, list[dict[str, object]]]) -> list[str]:
        return tool_pairs.body_problems(json.dumps(
            {"messages": [{"role": r, "content": c} for r, c in turns]}), BEDROCK)

    def use(i: str) -> dict[str, object]:
        return {"toolUse": {"toolUseId": i, "name": "f", "input": {}}}

    def res(i: str) -> dict[str, object]:
        return {"toolResult": {"toolUseId": i, "content": [{"text": "x"}]}}

    hi = {"text": "hi"}
    point = {"cachePoint": {"type": "default"}}
    assert problems(("user", [hi]), ("assistant", [use("a"), use("b"), point]),
                    ("user", [res("b"), res("a"), point, hi])) == []
    late = problems(("user", [hi]), ("assistant", [use("a")]), ("user", [hi]),
                    ("assistant", [hi]), ("user", [res("a")]))
    assert any("not answered in the next user message" in p for p in late), late
    assert any("does not follow its toolUse" in p for p in late), late
    assert any("toolResult after other content" in p for p in problems(
        ("user", [hi]), ("assistant", [use("a")]), ("user", [hi, res("a")])))
    assert any("answered twice" in p for p in problems(
        ("user", [hi]), ("assistant", [use("a")]), ("user", [res("a"), res("a")])))
    assert any("two 'user' messages in a row" in p
               for p in problems(("user", [hi]), ("user", [hi])))
    assert any("first message must be the user's" in p
               for p in problems(("assistant", [hi])))


def envelope(body: str, nonce: str = "0123456789abcdef", close: bool = True) -> str:
    text = f'<untrusted source="tool:web.fetch" id="r1" nonce="{nonce}">\n{body}\n'
    return text + (f"</untrusted:{nonce}>" if close else "")


def answer(*messages: pb.Message, body: str = "",
           fmt: pb.ProviderFormat.ValueType = pb.PROVIDER_FORMAT_UNSPECIFIED) -> pb.BuildResponse:
    return pb.BuildResponse(request=request(*messages), provider_body_json=body,
                            provider_format=fmt)


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
    assert fuzz.build_answer_problems(build(ANTHROPIC), fine) == [
        "asked for format 1, the response says 0"]
    broken = answer(user(), call("a"), result("a"),
                    body=json.dumps({"input": [{"type": "function_call_output",
                                                "call_id": "a", "output": "x"}]}), fmt=OPENAI)
    assert any(p.startswith("provider body PROVIDER_FORMAT_OPENAI_RESPONSES")
               for p in fuzz.build_answer_problems(build(OPENAI), broken))
    # the model's default when none was asked: checked in the format the response names
    assert any(p.startswith("provider body PROVIDER_FORMAT_OPENAI_RESPONSES")
               for p in fuzz.build_answer_problems(build(), broken))
    unnamed = answer(user(), body="{}")
    assert "a provider body without its format" in fuzz.build_answer_problems(build(), unnamed)
    none_asked = fuzz.build_answer_problems(build(pb.PROVIDER_FORMAT_NONE), broken)
    assert "asked for no provider body, got one" in none_asked


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
