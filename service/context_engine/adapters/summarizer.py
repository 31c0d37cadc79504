"""The LLM summarizer: an OpenAI-compatible chat-completions endpoint (spec: "Compaction").

It implements the domain's ``Summarizer`` port. It only ever receives a ``SummaryInput`` —
trusted content chosen by the compactor — so nothing below USER can reach the model. Its
prompt is a versioned file (``assets/summarizer_prompt.md``, first line ``version: ...``)
whose version is recorded on every result. A 5xx answer, a timeout past the deadline, an
unreachable endpoint or an unreadable answer raise ``SummarizerUnavailable`` (gRPC
UNAVAILABLE); the compaction then stores nothing.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from context_engine.adapters.assets import DEFAULT_ASSETS_DIR
from context_engine.domain.compaction import Summarized, SummaryInput
from context_engine.domain.errors import SummarizerUnavailable

PROMPT_FILE = "summarizer_prompt.md"


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


class OpenAISummarizer:
    def __init__(self, *, url: str, model: str, api_key: str = "", timeout: float = 20.0,
                 prompt: Prompt | None = None) -> None:
        self._url = url.rstrip("/")
        if not self._url.endswith("/chat/completions"):
            self._url += "/chat/completions"
        self._model = model
        self._key = api_key
        self._timeout = timeout
        self._prompt = prompt or load_prompt()

    @property
    def version(self) -> str:
        return f"llm:{self._model}:{self._prompt.version}"

    def _post(self, body: bytes) -> bytes:
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        request = urllib.request.Request(self._url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as response:
                data: bytes = response.read()
                return data
        except urllib.error.HTTPError as exc:
            raise SummarizerUnavailable(f"HTTP {exc.code}") from None
        except (TimeoutError, urllib.error.URLError, OSError,
                http.client.HTTPException) as exc:  # e.g. BadStatusLine, IncompleteRead
            raise SummarizerUnavailable(type(exc).__name__) from None

    async def summarize(self, data: SummaryInput, max_chars: int) -> Summarized:
        body = json.dumps({
            "model": self._model,
            "temperature": 0,
            "messages": [{"role": "system", "content": self._prompt.text},
                         {"role": "user", "content": user_content(data, max_chars)}],
        }).encode("utf-8")
        try:
            raw = await asyncio.wait_for(asyncio.to_thread(self._post, body),
                                         self._timeout + 1.0)
        except TimeoutError:
            raise SummarizerUnavailable("deadline exceeded") from None
        try:
            answer = json.loads(raw)
            text = answer["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise SummarizerUnavailable("unreadable answer") from None
        if not isinstance(text, str):
            raise SummarizerUnavailable("unreadable answer")
        return Summarized(narrative=text.strip()[:max_chars], version=self.version)
