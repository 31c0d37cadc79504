"""The LLM summarizer: an OpenAI-compatible chat-completions endpoint, called with the official
``openai`` SDK (spec: "Compaction").

It implements the domain's ``Summarizer`` port. It only ever receives a ``SummaryInput`` —
trusted content chosen by the compactor — so nothing below USER can reach the model. Its
prompt is a versioned file (``assets/summarizer_prompt.md``, first line ``version: ...``)
whose version is recorded on every result. Any failure — an error status, a timeout past the
deadline, an unreachable endpoint, an unreadable answer, or one the model did not finish (cut
at its output limit, ``finish_reason`` ``length``; withheld by a content filter; empty when
text was asked for and there was content to summarize) — raises ``SummarizerUnavailable``
(gRPC UNAVAILABLE), except a 4xx answer other than 408, 409 and 429, which no retry changes (a
wrong key, a model or URL that does not exist, a request the model refuses): that raises
``SummarizerRefused`` (gRPC FAILED_PRECONDITION, which clients do not retry). Either way the
compaction stores nothing.

Retries are the SDK's: at most ``max_retries`` more attempts (``CE_SUMMARIZER_MAX_RETRIES``),
only after a connection error, a timeout or a 408, 409, 429 or 5xx answer (never another 4xx),
with its backoff (0.5 s doubling, or the answer's Retry-After). All attempts and the pauses
between them share one deadline, ``timeout``: past it the call fails whatever the SDK would
still try, and an answer whose Retry-After ends past it fails the call at once (waiting it out
would only spend the deadline)."""

from __future__ import annotations

import asyncio
import contextvars
import email.utils
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from context_engine.adapters.assets import DEFAULT_ASSETS_DIR
from context_engine.clock import SYSTEM_CLOCK
from context_engine.domain.compaction import Summarized, SummaryInput
from context_engine.domain.errors import SummarizerRefused, SummarizerUnavailable

PROMPT_FILE = "summarizer_prompt.md"


def _encodable(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (a JSON answer may spell a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _has_content(data: SummaryInput) -> bool:
    """Whether the summarizer was given anything to summarize (a replaced span may hold
    nothing above USER: pointers alone, which it is not given)."""
    return bool(data.lines or data.goal or data.open_questions or data.prior_narrative)


@dataclass(frozen=True, kw_only=True, slots=True)
class Prompt:
    version: str
    text: str


def load_prompt(directory: Path = DEFAULT_ASSETS_DIR) -> Prompt:
    path = directory / PROMPT_FILE
    if not path.exists():
        path = DEFAULT_ASSETS_DIR / PROMPT_FILE
    raw = path.read_text(encoding="utf-8")
    head, sep, body = raw.partition("\n---\n")
    if not sep or not head.startswith("version:"):
        raise ValueError(f"{path} must start with 'version: ...' and a '---' line")
    return Prompt(version=head.removeprefix("version:").strip(), text=body.strip())


def user_content(data: SummaryInput, max_chars: int) -> str:
    parts = [f"Character limit: {max_chars}", f"Reason for compaction: {data.reason}"]
    if data.goal:
        parts.append(f"Stated objective: {data.goal}")
    if data.prior_narrative:
        parts += ["Earlier summary narrative:", data.prior_narrative]
    if data.open_questions:
        parts += ["Open questions:", *(f"- {q}" for q in data.open_questions)]
    parts.append("Conversation (oldest first):")
    for line in data.lines:
        what = f"called tool(s) {line.text}" if line.role == "tool_call" else line.text
        parts.append(f"[{line.sequence}] {line.role}: {what}")
    return "\n".join(parts)


# Attempts after the first one (the SDK's default; CE_SUMMARIZER_MAX_RETRIES sets it), all
# within the call's deadline.
MAX_RETRIES = 2
# The SDK refuses to build a client without a key; a keyless endpoint gets this one, which
# never leaves the process: each request then omits the Authorization header.
_NO_KEY = "unused"
_CODE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
# The 4xx statuses the SDK retries as transient (timeout, conflict, rate limit): unavailable,
# as a 5xx is. Any other 4xx is a refusal no retry changes.
_TRANSIENT_4XX = frozenset({408, 409, 429})

if TYPE_CHECKING:
    import httpx2
    from openai import AsyncOpenAI

# When the summarize call running in this task must end, on the event loop's clock.
_DEADLINE: contextvars.ContextVar[float] = contextvars.ContextVar("summarizer_deadline")
# Set on an answer whose Retry-After ends past the call's deadline: its delay in seconds.
_PAST_DEADLINE = "x-context-engine-retry-after-past-deadline"


def retry_after(headers: httpx2.Headers, now: float) -> float | None:
    """The delay an answer asks for, in seconds, as the SDK reads it: ``retry-after-ms``, then
    ``retry-after`` in seconds or as an HTTP date (less ``now``, a POSIX time); None when it
    asks for none."""
    for name, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            delay = float(value)
        except ValueError:
            continue
        return delay / divisor if math.isfinite(delay) else math.inf
    when = email.utils.parsedate_tz(headers.get("retry-after") or "")
    if when is None:
        return None
    try:
        return float(email.utils.mktime_tz(when) - now)
    except (OverflowError, ValueError):
        return None


async def _no_wait_past_deadline(response: httpx2.Response) -> None:
    """httpx's response hook: an answer asking to be retried only after the call's deadline is
    not retried (``x-should-retry: false``, which the SDK obeys); the call fails with it now."""
    if response.status_code not in _TRANSIENT_4XX and response.status_code < 500:
        return  # an answer the SDK does not retry anyway
    deadline = _DEADLINE.get(None)
    if deadline is None:
        return
    # an HTTP date against the machine's clock, as the SDK that waits for it reads it (a test
    # server's injected clock would disagree with that wait)
    delay = retry_after(response.headers, SYSTEM_CLOCK.now().timestamp())
    if delay is None or delay <= 0:
        return
    if delay > deadline - asyncio.get_running_loop().time():
        response.headers["x-should-retry"] = "false"
        response.headers[_PAST_DEADLINE] = f"{delay:.0f}" if delay < 1e9 else "inf"


def base_url(url: str) -> str:
    """The API base the SDK posts ``/chat/completions`` under: CE_SUMMARIZER_URL is that base
    (``https://host/v1``); a URL naming the endpoint itself is accepted too."""
    return url.rstrip("/").removesuffix("/chat/completions")


def _status_why(status: int, code: object) -> str:
    """``HTTP <status>``, with the error body's ``code`` when it is a plain identifier (the
    provider's message may quote the request, so it is never kept)."""
    if isinstance(code, str) and _CODE.fullmatch(code):
        return f"HTTP {status} ({code})"
    return f"HTTP {status}"


class OpenAISummarizer:
    def __init__(self, *, url: str, model: str, api_key: str = "", timeout: float = 20.0,
                 prompt: Prompt | None = None, max_retries: int = MAX_RETRIES) -> None:
        # The SDK is loaded with the summarizer (a server with a summarizer URL makes it at
        # start-up): loaded at the first Compact instead, its import (0.6 s here) held the
        # event loop, every RPC of the replica, and was spent from that Compact's deadline.
        import openai  # noqa: F401

        self._base_url = base_url(url)
        self._model = model
        self._key = api_key
        self._timeout = timeout
        self._max_retries = max_retries
        self._prompt = prompt or load_prompt()
        self._client: AsyncOpenAI | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def version(self) -> str:
        return f"llm:{self._model}:{self._prompt.version}"

    def _client_here(self) -> AsyncOpenAI:
        """One client (and its connection pool) per event loop: a server has one loop; a
        caller that runs each call in a loop of its own gets a client for each."""
        from openai import AsyncOpenAI, omit  # loaded with the summarizer

        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            # Never sent to an endpoint that may not be OpenAI's: organization and project
            # headers the SDK would take from OPENAI_ORG_ID/OPENAI_PROJECT_ID.
            headers: dict[str, Any] = {"OpenAI-Organization": omit, "OpenAI-Project": omit}
            from openai import DefaultAsyncHttpxClient

            http = DefaultAsyncHttpxClient(event_hooks={"response": [_no_wait_past_deadline]})
            self._client = AsyncOpenAI(base_url=self._base_url, api_key=self._key or _NO_KEY,
                                       timeout=self._timeout, max_retries=self._max_retries,
                                       default_headers=headers, http_client=http)
            self._loop = loop
        return self._client

    async def aclose(self) -> None:
        """Close the connections of the current loop's client, if it has one."""
        client, self._client = self._client, None
        if client is not None and self._loop is asyncio.get_running_loop():
            await client.close()

    async def summarize(self, data: SummaryInput, max_chars: int) -> Summarized:
        import openai

        client = self._client_here()
        # keyless: the SDK leaves Authorization out only when the request itself omits it
        headers: dict[str, Any] = {} if self._key else {"Authorization": openai.omit}
        deadline = _DEADLINE.set(asyncio.get_running_loop().time() + self._timeout)
        try:
            async with asyncio.timeout(self._timeout):
                completion = await client.chat.completions.create(
                    model=self._model,
                    temperature=0,
                    messages=[{"role": "system", "content": self._prompt.text},
                              {"role": "user", "content": user_content(data, max_chars)}],
                    extra_headers=headers)
        except TimeoutError:
            raise SummarizerUnavailable("deadline exceeded") from None
        except openai.APIStatusError as exc:
            why = _status_why(exc.status_code, exc.code)
            past = exc.response.headers.get(_PAST_DEADLINE)
            if past is not None:
                why += f", Retry-After {past} s is past the call's deadline"
            if 400 <= exc.status_code < 500 and exc.status_code not in _TRANSIENT_4XX:
                raise SummarizerRefused(why) from None
            raise SummarizerUnavailable(why) from None
        except openai.APITimeoutError:
            raise SummarizerUnavailable("timeout") from None
        except openai.APIConnectionError as exc:  # refused, reset, not HTTP, truncated, ...
            cause = exc.__cause__
            raise SummarizerUnavailable(type(cause).__name__ if cause is not None
                                        else "connection error") from None
        except (openai.OpenAIError, ValueError, RecursionError):
            # a body that is no completion: not JSON, or JSON nested too deep to parse
            raise SummarizerUnavailable("unreadable answer") from None
        finally:
            _DEADLINE.reset(deadline)
        try:
            choice = completion.choices[0]
            text = choice.message.content
        except (AttributeError, IndexError, TypeError):
            raise SummarizerUnavailable("unreadable answer") from None
        if not isinstance(text, str):
            raise SummarizerUnavailable("unreadable answer")
        # an answer the model did not finish is no summary: taken as written, its end (the
        # open questions) was lost unsaid, and an empty one (a reasoning model that spent its
        # output on reasoning) replaced the conversation with nothing
        finish = getattr(choice, "finish_reason", None)
        if finish == "length":
            raise SummarizerUnavailable("answer cut at the model's output limit")
        if finish == "content_filter":
            raise SummarizerUnavailable("answer withheld by the provider's content filter")
        if max_chars > 0 and not text.strip() and _has_content(data):
            raise SummarizerUnavailable("empty answer")
        if "\x00" in text or not _encodable(text):  # jsonb holds no NUL; UTF-8 no lone surrogate
            raise SummarizerUnavailable("unreadable answer (a NUL or a lone surrogate)")
        # as written, uncut: the compactor measures it, asks once more within a smaller
        # allowance when it is over the summary's cap, and only then cuts it in its middle (a
        # cut at max_chars here took the answer's end, its open questions, unsaid)
        return Summarized(narrative=text.strip(), version=self.version)
