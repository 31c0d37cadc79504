"""What `make bench` sets beside Build, in process: raw counter passes over a conversation's
content and langchain-core ``trim_messages`` with an uncached or a memoized counter.

* ``service_bpe_count``: the counter the service itself counts with, GitHub's ``bpe`` crate
  through PyPI ``bpe-openai`` (``bundled_bpe_counter("cl100k_base")``, cached once per process,
  so the very function object the server's ``TiktokenCounter`` calls).
* ``tiktoken_count``: ``len(encode_ordinary(text))``, the usual tiktoken count (a reference: the
  service does not count with it when bpe-openai is there).
* ``uncached_counter``: a message counter for ``trim_messages`` that counts every message it is
  given, every time (the OpenAI cookbook framing: 3 tokens a message, 3 for the reply; tool
  calls' names and arguments counted too).
* ``MemoCounter``: the same counts, memoized per message (keyed by message id and content), so
  that after a first call ``trim_messages`` counts nothing again: its cached path.

Each timed function returns milliseconds beside its result; nothing here starts a server.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

Count = Callable[[str], int]
MessageCounter = Callable[[list[Any]], int]

TRIM_OPTIONS: dict[str, Any] = {"strategy": "last", "include_system": True,
                                "allow_partial": False, "start_on": "human"}


def service_bpe_count() -> Count:
    """The service's own counting function for cl100k_base (bpe-openai), or an error saying
    why the service would not use it."""
    from context_engine.adapters.tokenizers import bundled_bpe_counter

    count = bundled_bpe_counter("cl100k_base")
    if count is None:
        raise RuntimeError("bpe-openai is missing or its cl100k_base vocabulary is not the "
                           "official file: the service would count with tiktoken")
    return count


def tiktoken_count(encoding: Any) -> Count:
    def count(text: str) -> int:
        return len(encoding.encode_ordinary(text))
    return count


def counter_pass(count: Count, texts: Sequence[str]) -> tuple[float, int]:
    """One single-threaded pass of ``count`` over ``texts``: (ms, tokens)."""
    started = time.perf_counter()
    tokens = sum(count(t) for t in texts)
    return (time.perf_counter() - started) * 1000, tokens


def message_tokens(count: Count, message: Any) -> int:
    n = 3
    if isinstance(message.content, str):
        n += count(message.content)
    for call in getattr(message, "tool_calls", None) or ():
        n += count(call["name"])
        n += count(json.dumps(call["args"], separators=(",", ":")))
    return n


def uncached_counter(count: Count) -> MessageCounter:
    """Counts every message of every list it is given (trim_messages' binary search gives it
    about log2(n) + 2 lists, so most content is counted several times)."""

    def counter(messages: list[Any]) -> int:
        return 3 + sum(message_tokens(count, m) for m in messages)
    return counter


class MemoCounter:
    """``uncached_counter``'s counts, memoized per message: a dict keyed by (message id,
    content). Warmed by a first ``trim_messages`` call, later calls only look messages up."""

    def __init__(self, count: Count) -> None:
        self.count = count
        self.memo: dict[tuple[str | None, str], int] = {}
        self.misses = 0

    def __call__(self, messages: list[Any]) -> int:
        memo = self.memo
        n = 3
        for m in messages:
            key = (m.id, m.content)
            hit = memo.get(key)
            if hit is None:
                hit = memo[key] = message_tokens(self.count, m)
                self.misses += 1
            n += hit
        return n


def trim(messages: list[Any], max_tokens: int, counter: MessageCounter) -> tuple[float, list[Any]]:
    """One timed ``trim_messages(strategy="last", include_system, whole messages, start on a
    human message)``: (ms, messages kept)."""
    from langchain_core.messages import trim_messages

    started = time.perf_counter()
    kept = trim_messages(messages, max_tokens=max_tokens, token_counter=counter, **TRIM_OPTIONS)
    return (time.perf_counter() - started) * 1000, kept
