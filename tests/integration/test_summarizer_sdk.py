"""The LLM summarizer through the official openai SDK, against a real chat-completions endpoint
on loopback (no mock of the SDK): what it sends, the SDK's retries within one deadline, how
each failure maps to SUMMARIZER_UNAVAILABLE (a 4xx no retry changes to SUMMARIZER_REFUSED), and
the API key only ever in the bearer header."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from context_engine.adapters.summarizer import MAX_RETRIES, OpenAISummarizer, base_url, load_prompt
from context_engine.domain.compaction import Summarized, SummaryInput, TrustedLine
from context_engine.domain.errors import SummarizerRefused, SummarizerUnavailable

KEY = "sk-CANARY-5b8e-summarizer-key"
TEXT = "CANARY-91c4 the user's words"


@dataclass
class Answer:
    status: int = 200
    body: Any = None  # a dict is sent as JSON; bytes as they are; None: a completion
    delay: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)


def completion(text: str | None, finish_reason: str | None = "stop") -> dict[str, Any]:
    return {"id": "c-1", "object": "chat.completion", "created": 0, "model": "fake-model",
            "choices": [{"index": 0, "finish_reason": finish_reason,
                         "message": {"role": "assistant", "content": text}}]}


class Endpoint:
    """POST <anything>: answers from ``script`` in order, the last entry repeating. Keeps each
    request's path, headers and JSON body in ``seen``."""

    def __init__(self, *script: Answer) -> None:
        self.script = list(script) or [Answer()]
        self.seen: list[dict[str, Any]] = []
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                headers = {k.lower(): v for k, v in self.headers.items()}
                endpoint.seen.append({"path": self.path, "headers": headers,
                                      "body": json.loads(raw)})
                index = min(len(endpoint.seen), len(endpoint.script)) - 1
                answer = endpoint.script[index]
                time.sleep(answer.delay)
                body = answer.body if answer.body is not None else completion("a summary")
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                try:
                    self.send_response(answer.status)
                    for name, value in {"Content-Type": "application/json",
                                        **answer.headers}.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up first
                    pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/v1"

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    e = Endpoint()
    yield e
    e.stop()


def data() -> SummaryInput:
    return SummaryInput(reason="budget_pressure", goal="plan the trip", constraints=("be brief",),
                        open_questions=("which hotel?",),
                        lines=(TrustedLine(item_id="u1", sequence=1, role="user", text=TEXT),
                               TrustedLine(item_id="a1", sequence=2, role="assistant",
                                           text="Sure.")),
                        pointers=(), prior_narrative="", source_event_ids=(1, 2))


def summarize(s: OpenAISummarizer, max_chars: int = 1000) -> Summarized:
    return asyncio.run(s.summarize(data(), max_chars))


def failure(s: OpenAISummarizer, raised: type[SummarizerUnavailable | SummarizerRefused]
            = SummarizerUnavailable) -> tuple[Any, float]:
    started = time.monotonic()
    with pytest.raises(raised) as info:
        summarize(s)
    return info.value, time.monotonic() - started


def llm(endpoint: Endpoint, *, key: str = KEY, timeout: float = 5.0,
        url: str | None = None) -> OpenAISummarizer:
    return OpenAISummarizer(url=url or endpoint.url, model="fake-model", api_key=key,
                            timeout=timeout)


def test_a_completion_is_the_narrative_and_the_key_is_the_bearer(endpoint):
    endpoint.script = [Answer(body=completion("  The user plans a trip.  "))]
    s = llm(endpoint)
    result = summarize(s)
    assert result.narrative == "The user plans a trip."
    assert result.version == f"llm:fake-model:{load_prompt().version}"
    [seen] = endpoint.seen
    assert seen["path"] == "/v1/chat/completions"
    assert seen["headers"]["authorization"] == f"Bearer {KEY}"
    assert not {"openai-organization", "openai-project"} & set(seen["headers"])
    body = seen["body"]
    assert body["model"] == "fake-model" and body["temperature"] == 0
    system, user = body["messages"]
    assert system == {"role": "system", "content": load_prompt().text}
    assert user["role"] == "user" and f"[1] user: {TEXT}" in user["content"]
    assert "Stated objective: plan the trip" in user["content"]
    assert "Open questions:\n- which hotel?\n" in user["content"]
    # the limit is asked for, and the answer returned as written: the compactor measures it
    # (test_an_answer_over_its_allowance_is_asked_again_then_cut_in_its_middle)
    assert summarize(s, max_chars=8).narrative == "The user plans a trip."
    assert "Character limit: 8" in endpoint.seen[-1]["body"]["messages"][1]["content"]


LONG = ("Goal: migrate the billing DB. " + "Detail. " * 400
        + "UNRESOLVED: user must confirm the cut-over window before anything runs.")


@pytest.mark.parametrize("second", ["within its allowance", "still over"])
def test_an_answer_over_its_allowance_is_asked_again_then_cut_in_its_middle(endpoint, second):
    """The adapter cut the model's answer at the character limit, from its end: the compactor
    never saw it over its cap, never asked again, and the open question at its end was lost
    unsaid. Now compact() measures the answer, asks once more within a smaller allowance, and
    only then cuts it in its middle, its end kept."""
    from context_engine.domain.compaction import Target, compact
    from context_engine.domain.items import AssistantMessageItem, RenderContext, UserMessageItem
    from context_engine.domain.trust import TrustLevel

    short = "Goal: migrate the billing DB. UNRESOLVED: confirm the cut-over window."
    endpoint.script = [Answer(body=completion(LONG)),
                       Answer(body=completion(short if second.startswith("within") else LONG))]
    items = [UserMessageItem(id="u1", sequence=1, run_id="r0", item_trust=TrustLevel.USER,
                             text="Migrate billing"),
             AssistantMessageItem(id="a1", sequence=2, run_id="r0", item_trust=TrustLevel.USER,
                                  text="ok"),
             UserMessageItem(id="u2", sequence=3, run_id="r1", item_trust=TrustLevel.USER,
                             text="go")]
    r = asyncio.run(compact(items, None, active_run_id="r1", target=Target(replace_through=2),
                            reason="budget_pressure", summarizer=llm(endpoint),
                            measure=lambda ms: sum(len(m.text) // 4 + 4 for m in ms),
                            ctx=RenderContext(session_key="sk"), max_summary_tokens=400))
    limits = [int(s["body"]["messages"][1]["content"].split("\n")[0].split(": ")[1])
              for s in endpoint.seen]
    # asked again, within less than it wrote (the allowance its text measured shows)
    assert len(limits) == 2 and limits[1] < len(LONG) // 2
    assert r.tokens_after <= 400
    if second.startswith("within"):
        assert r.summary == short
    else:  # cut in its middle: its opening and its end (the open question) kept
        assert r.summary.startswith("Goal: migrate the billing DB.") and "\u2026" in r.summary
        assert r.summary.endswith("before anything runs.")


@pytest.mark.parametrize("url", ["{base}", "{base}/", "{base}/chat/completions"])
def test_the_url_is_the_api_base_or_the_endpoint_itself(endpoint, url):
    summarize(llm(endpoint, url=url.format(base=endpoint.url)))
    assert [s["path"] for s in endpoint.seen] == ["/v1/chat/completions"]
    assert base_url("https://host/v1/chat/completions/") == "https://host/v1"


def test_a_500_is_retried_by_the_sdk(endpoint):
    endpoint.script = [Answer(status=500, body={"error": {"message": "boom"}}),
                       Answer(body=completion("after a retry"))]
    assert summarize(llm(endpoint)).narrative == "after a retry"
    assert len(endpoint.seen) == 2
    assert endpoint.seen[0]["body"] == endpoint.seen[1]["body"]


def test_retries_are_bounded(endpoint):
    endpoint.script = [Answer(status=503, body={"error": {"message": "overloaded"}})]
    err, _ = failure(llm(endpoint, timeout=10.0))
    assert len(endpoint.seen) == 1 + MAX_RETRIES == 3
    assert err.why == "HTTP 503" and err.reason == "SUMMARIZER_UNAVAILABLE"


def test_a_400_is_not_retried_and_says_what_failed(endpoint):
    endpoint.script = [Answer(status=400, body={"error": {
        "message": f"context too long: {TEXT}", "type": "invalid_request_error",
        "code": "context_length_exceeded"}})]
    err, _ = failure(llm(endpoint), SummarizerRefused)
    assert len(endpoint.seen) == 1
    assert err.why == "HTTP 400 (context_length_exceeded)"
    assert err.reason == "SUMMARIZER_REFUSED"
    assert str(err) == ("the summarizer refused the request: HTTP 400 (context_length_exceeded);"
                        " nothing was stored (check CE_SUMMARIZER_URL, CE_SUMMARIZER_MODEL and "
                        "CE_SUMMARIZER_API_KEY)")
    assert TEXT not in str(err)  # the provider's message may quote the request: never kept


def test_an_error_code_that_is_not_a_plain_identifier_is_left_out(endpoint):
    """The code of the error body is kept only when it is an identifier as a whole: one that
    merely starts like one may quote the request."""
    endpoint.script = [Answer(status=400, body={"error": {
        "message": "bad request", "type": "invalid_request_error",
        "code": f"context_length_exceeded {TEXT}"}})]
    err, _ = failure(llm(endpoint), SummarizerRefused)
    assert err.why == "HTTP 400"
    assert TEXT not in str(err)


def test_a_slow_endpoint_fails_at_the_deadline(endpoint):
    endpoint.script = [Answer(delay=3.0)]
    err, took = failure(llm(endpoint, timeout=0.5))
    assert err.why in ("deadline exceeded", "timeout")
    assert took < 1.5
    assert len(endpoint.seen) == 1  # one attempt used the whole deadline


def test_retries_never_outlast_the_deadline(endpoint):
    """A Retry-After the SDK would honour (up to 2 minutes) that ends past the call's deadline
    fails the call at once: waiting it out would only spend the deadline."""
    endpoint.script = [Answer(status=429, body={"error": {"message": "slow down"}},
                              headers={"Retry-After": "60"})]
    err, took = failure(llm(endpoint, timeout=3.0))
    assert err.why == "HTTP 429, Retry-After 60 s is past the call's deadline"
    assert err.reason == "SUMMARIZER_UNAVAILABLE"
    assert took < 1.5 and len(endpoint.seen) == 1


@pytest.mark.parametrize("headers", [
    {"Retry-After": "Fri, 31 Dec 2100 23:59:59 GMT"}, {"retry-after-ms": "4000"},
    {"Retry-After": "1e400"}])
def test_a_retry_after_past_the_deadline_in_any_spelling_fails_at_once(endpoint, headers):
    endpoint.script = [Answer(status=503, body={"error": {"message": "overloaded"}},
                              headers=headers)]
    err, took = failure(llm(endpoint, timeout=3.0))
    assert err.why.startswith("HTTP 503, Retry-After ") and "past the call's deadline" in err.why
    assert took < 1.5 and len(endpoint.seen) == 1


@pytest.mark.parametrize("headers", [{"Retry-After": "1"}, {"retry-after-ms": "600"}])
def test_a_retry_after_within_the_deadline_is_waited_and_retried(endpoint, headers):
    endpoint.script = [Answer(status=429, body={"error": {"message": "slow down"}},
                              headers=headers),
                       Answer(body=completion("after the wait"))]
    started = time.monotonic()
    assert summarize(llm(endpoint, timeout=5.0)).narrative == "after the wait"
    waited = float(headers.get("Retry-After", 0)) + float(headers.get("retry-after-ms", 0)) / 1000
    assert time.monotonic() - started >= waited and len(endpoint.seen) == 2


def test_a_retry_after_date_within_the_deadline_is_waited_and_retried(endpoint):
    """An HTTP date two seconds ahead is a delay within a 5 s deadline, read against the
    machine's clock as the SDK reads it: waited and retried, not failed at once."""
    import email.utils

    when = email.utils.formatdate(time.time() + 2, usegmt=True)
    endpoint.script = [Answer(status=503, body={"error": {"message": "overloaded"}},
                              headers={"Retry-After": when}),
                       Answer(body=completion("after the date"))]
    assert summarize(llm(endpoint, timeout=5.0)).narrative == "after the date"
    assert len(endpoint.seen) == 2


def test_a_refusal_with_a_retry_after_says_nothing_of_it(endpoint):
    """A 4xx the SDK never retries is refused as it is: its Retry-After changes nothing."""
    endpoint.script = [Answer(status=401, body={"error": {"message": "bad key"}},
                              headers={"Retry-After": "60"})]
    err, _ = failure(llm(endpoint), SummarizerRefused)
    assert err.why == "HTTP 401" and len(endpoint.seen) == 1


@pytest.mark.parametrize(("body", "content_type"), [
    (b"not json", "application/json"), (b"<html>a proxy's page</html>", "text/html"),
    ({"choices": []}, "application/json"), ({"object": "chat.completion"}, "application/json"),
    (completion(None), "application/json"),
    # nested past the parser's recursion limit: a RecursionError, once answered INTERNAL
    (b"[" * 100_000 + b"]" * 100_000, "application/json")])
def test_an_unreadable_answer_is_unavailable(endpoint, body, content_type):
    endpoint.script = [Answer(body=body, headers={"Content-Type": content_type})]
    err, _ = failure(llm(endpoint))
    assert err.why == "unreadable answer"


@pytest.mark.parametrize("content", ["Goal: ok \ud800 end", "Goal: ok \x00 end"])
def test_an_answer_no_summary_can_hold_is_unavailable(endpoint, content):
    """A lone surrogate (JSON may spell one) cannot be rendered as UTF-8, and a NUL cannot be
    stored in jsonb: either answered INTERNAL from deep in the Compact, not UNAVAILABLE."""
    endpoint.script = [Answer(body=completion(content))]
    err, _ = failure(llm(endpoint))
    assert err.why == "unreadable answer (a NUL or a lone surrogate)"


CUT = "Current goal: migrate the billing DB. Decisions taken: [3] the user chose"


@pytest.mark.parametrize(("body", "why"), [
    (completion(CUT, "length"), "answer cut at the model's output limit"),
    (completion("", "length"), "answer cut at the model's output limit"),
    (completion(CUT, "content_filter"), "answer withheld by the provider's content filter"),
    (completion(""), "empty answer"), (completion(" \n "), "empty answer")])
def test_an_answer_the_model_did_not_finish_is_unavailable(endpoint, body, why):
    """Taken as written, an answer cut at the model's output limit lost its end (the open
    questions) unsaid, and an empty one (a reasoning model that spent its output tokens on
    reasoning answers "" with finish_reason "length") replaced the conversation with nothing:
    either was stored as the summary of the items it replaced."""
    endpoint.script = [Answer(body=body)]
    err, _ = failure(llm(endpoint))
    assert err.why == why
    assert len(endpoint.seen) == 1  # an answer, not a failure the SDK retries


@pytest.mark.parametrize("finish_reason", ["stop", None, "eos_token", "tool_calls"])
def test_a_finished_answer_is_the_narrative_whatever_else_the_endpoint_says(endpoint,
                                                                             finish_reason):
    endpoint.script = [Answer(body=completion(CUT, finish_reason))]
    assert summarize(llm(endpoint)).narrative == CUT
    # nothing asked for, nothing expected: an empty answer within no allowance is no failure,
    # nor one where nothing above USER was replaced (pointers alone, which it is not given)
    endpoint.script = [Answer(body=completion("", finish_reason))]
    assert summarize(llm(endpoint), max_chars=0).narrative == ""
    nothing = SummaryInput(reason="budget_pressure", goal="", constraints=(), open_questions=(),
                           lines=(), pointers=("[elided] tool.result r1",), prior_narrative="",
                           source_event_ids=(3,))
    assert asyncio.run(llm(endpoint).summarize(nothing, 1000)).narrative == ""


def test_an_unreachable_endpoint_is_unavailable(endpoint):
    url = endpoint.url
    endpoint.stop()
    err, took = failure(OpenAISummarizer(url=url, model="m", api_key=KEY, timeout=5.0))
    assert err.why == "ConnectError" and took < 5.0


def test_without_a_key_no_authorization_is_sent(endpoint, monkeypatch):
    """Nothing from the SDK's own variables reaches the endpoint: not OPENAI_API_KEY for a
    keyless one, nor the organization and project."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-the-environment")
    monkeypatch.setenv("OPENAI_ORG_ID", "org-from-the-environment")
    monkeypatch.setenv("OPENAI_PROJECT_ID", "proj-from-the-environment")
    summarize(llm(endpoint, key=""))
    summarize(llm(endpoint))
    keyless, keyed = (s["headers"] for s in endpoint.seen)
    assert "authorization" not in keyless and keyed["authorization"] == f"Bearer {KEY}"
    for headers in (keyless, keyed):
        assert "environment" not in repr(headers)


def test_the_key_is_never_logged(endpoint, caplog):
    """Every logger at DEBUG (the SDK's and its HTTP client's included), across a success, a
    retried 5xx and a refused key: the key appears in no record and in no error."""
    caplog.set_level(logging.DEBUG)
    endpoint.script = [Answer(), Answer(status=502, body={"error": {"message": "bad gateway"}}),
                       Answer(), Answer(status=401, body={"error": {
                           "message": f"Incorrect API key provided: {KEY}",
                           "code": "invalid_api_key"}})]
    s = llm(endpoint)
    summarize(s)
    summarize(s)  # 502, then retried
    err, _ = failure(s, SummarizerRefused)
    assert err.why == "HTTP 401 (invalid_api_key)"
    assert len(endpoint.seen) == 4
    assert all(seen["headers"]["authorization"] == f"Bearer {KEY}" for seen in endpoint.seen)
    assert caplog.records  # the SDK did log (its retry, its requests)
    for record in caplog.records:
        assert KEY not in record.getMessage() and KEY not in repr(record.__dict__)
    assert KEY not in str(err) and KEY not in repr(err.metadata())


def test_one_summarizer_serves_several_event_loops(endpoint):
    """A server has one loop; a caller running each call in a loop of its own (asyncio.run)
    gets a client per loop rather than connections of a closed one."""
    s = llm(endpoint)
    for _ in range(3):
        assert summarize(s).narrative == "a summary"

    async def twice() -> None:
        await s.summarize(data(), 100)
        await s.summarize(data(), 100)
        await s.aclose()

    asyncio.run(twice())
    assert len(endpoint.seen) == 5


def test_the_sdk_is_loaded_with_the_summarizer_not_at_the_first_compact():
    """A server without a summarizer URL never loads the SDK; one with it loads it at start-up,
    when the summarizer is made: loaded by the first Compact, the import held the event loop
    and was spent from that Compact's deadline."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from context_engine.api.server import summarizer_for\n"
            "from context_engine.config import Config\n"
            "assert 'openai' not in sys.modules\n"
            "summarizer_for(Config(summarizer_url=''))\n"
            "assert 'openai' not in sys.modules, 'loaded without a summarizer URL'\n"
            "summarizer_for(Config(summarizer_url='http://127.0.0.1:9/v1', summarizer_model='m'))\n"
            "assert 'openai' in sys.modules, 'not loaded with the summarizer'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
