"""The model catalog (``data/models.json``): every entry's default provider format, Claude on
Amazon Bedrock by model id and inference profile, Gemini's explicit-caching minimums, and the
optional keys validated when the catalog loads."""

from __future__ import annotations

import json
from typing import Any

import pytest
from context_engine.adapters.assets import DEFAULT_CATALOG, load_model_catalog
from context_engine.domain import providers as p
from context_engine.domain.calibration import least_factor
from context_engine.domain.estimator import ModelCatalog
from hypothesis import given, settings
from hypothesis import strategies as st

CATALOG = load_model_catalog()
DATA: dict[str, Any] = json.loads(DEFAULT_CATALOG.read_text(encoding="utf-8"))
BEDROCK_PREFIXES = ("", "us.", "eu.", "apac.", "global.")


def entry(model_id: str) -> Any:
    found = CATALOG.lookup(model_id)
    assert found is not None, model_id
    return found


def test_every_entry_names_a_default_format_of_its_provider() -> None:
    expected = {"openai": p.OPENAI_RESPONSES, "anthropic": p.ANTHROPIC_MESSAGES,
                "google": p.GEMINI_GENERATE_CONTENT, "bedrock": p.BEDROCK_CONVERSE}
    for e in DATA["models"]:
        assert e["provider_format"] in p.FORMATS, e["prefix"]
        if e["prefix"] == "gpt-oss":  # open weights, served by OpenAI-compatible servers
            assert e["provider_format"] == p.OPENAI_CHAT_COMPLETIONS
        else:
            assert e["provider_format"] == expected[e["provider"]], e["prefix"]


@pytest.mark.parametrize("region", BEDROCK_PREFIXES)
def test_claude_on_bedrock_is_sized_as_claude_and_defaults_to_converse(region: str) -> None:
    claude = entry("claude-sonnet-4-5")
    for model in ("anthropic.claude-sonnet-4-5-20250929-v1:0",
                  "anthropic.claude-haiku-4-5-20251001-v1:0",
                  "anthropic.claude-opus-4-1-20250805-v1:0"):
        e = entry(region + model)
        assert e.prefix.startswith(f"{region}anthropic.claude-")
        assert e.provider == "bedrock" and e.provider_format == p.BEDROCK_CONVERSE
        assert (e.encoding, e.context_window, e.output_reserve, e.base_factor) == (
            claude.encoding, claude.context_window, claude.output_reserve, claude.base_factor)
        assert e.breakpoint_budget == 4  # Bedrock's cache checkpoints per request
        assert CATALOG.default_format(region + model) == p.BEDROCK_CONVERSE


# Each model's maximum output, from its provider's model page: the output reserve is what
# max_tokens / max_output_tokens asks, and a provider answers 400 to more than the model takes.
MAX_OUTPUT = {
    "claude-3-haiku-20240307": 4_096, "claude-3-opus-20240229": 4_096,
    "claude-3-5-haiku-20241022": 8_192, "claude-3-5-sonnet-20241022": 8_192,
    "claude-3-7-sonnet-20250219": 64_000, "claude-sonnet-4-5": 64_000,
    "o1-mini": 65_536, "o1-preview": 32_768, "o1": 100_000, "o3-mini": 100_000,
    "gpt-5-chat-latest": 16_384, "gpt-5": 128_000, "gpt-4o": 16_384, "gpt-4o-mini": 16_384,
    "gpt-4o-2024-05-13": 4_096, "gpt-4o-2024-08-06": 16_384,
}


@pytest.mark.parametrize(("sent", "model_id"), [
    (region + model_id, model_id) for model_id in sorted(MAX_OUTPUT)
    for region in (["", *[r + "anthropic." for r in BEDROCK_PREFIXES]]
                   if model_id.startswith("claude-") else [""])])  # Bedrock's: Claude
def test_the_output_reserve_is_within_what_the_model_returns(sent: str, model_id: str) -> None:
    e = entry(sent)
    assert 0 < e.output_reserve <= MAX_OUTPUT[model_id], (e.prefix, e.output_reserve)


# Bedrock's prompt caching by model, from AWS's "Prompt caching for faster model inference" page
# (not from models.json): the Claude models whose requests may carry cachePoint blocks (Bedrock
# refuses one for any other; Claude 3.5 Sonnet v2 is offered to preview customers only, so not
# here), and of them those that take a one-hour ttl (AWS, January 2026: "Amazon Bedrock
# one-hour duration prompt caching": Sonnet 4.5, Haiku 4.5, Opus 4.5 and later).
BEDROCK_CACHING = {  # model id: takes ttl 1h (None: no cache point at all)
    "anthropic.claude-3-haiku-20240307-v1:0": None,
    "anthropic.claude-3-sonnet-20240229-v1:0": None,
    "anthropic.claude-3-opus-20240229-v1:0": None,
    "anthropic.claude-3-5-sonnet-20240620-v1:0": None,
    "anthropic.claude-3-5-sonnet-20241022-v2:0": None,
    "anthropic.claude-3-5-haiku-20241022-v1:0": False,
    "anthropic.claude-3-7-sonnet-20250219-v1:0": False,
    "anthropic.claude-sonnet-4-20250514-v1:0": False,
    "anthropic.claude-opus-4-20250514-v1:0": False,
    "anthropic.claude-opus-4-1-20250805-v1:0": False,
    "anthropic.claude-sonnet-4-5-20250929-v1:0": True,
    "anthropic.claude-haiku-4-5-20251001-v1:0": True,
    "anthropic.claude-opus-4-5-20251101-v1:0": True,
    "anthropic.claude-opus-4-6-v1": True,
    "anthropic.claude-sonnet-4-6": True,
}


@pytest.mark.parametrize(("model_id", "hour"), [
    (region + model_id, hour) for model_id, hour in sorted(BEDROCK_CACHING.items())
    for region in BEDROCK_PREFIXES])
def test_bedrock_cache_points_and_their_ttl_are_what_bedrock_takes(model_id: str,
                                                                  hour: bool | None) -> None:
    e = entry(model_id)
    assert e.provider == "bedrock"
    assert e.breakpoint_budget == (0 if hour is None else 4), e.prefix
    assert e.long_ttl is bool(hour), e.prefix


def test_only_bedrock_entries_take_the_hour_flag() -> None:
    """The Anthropic API takes ttl 1h on every current Claude model: only Bedrock's entries
    say which do; a Claude 3 entry of the API keeps its cache breakpoints."""
    for e in DATA["models"]:
        assert "long_ttl" not in e or e["provider"] == "bedrock", e["prefix"]
    for model_id in ("claude-3-haiku-20240307", "claude-3-5-sonnet-20241022",
                     "claude-3-opus-20240229"):
        assert entry(model_id).breakpoint_budget == 4


@pytest.mark.parametrize(("model_id", "minimum"), [
    ("gemini-2.5-flash", 1_024),
    ("gemini-2.5-flash-preview-09-2025", 1_024),
    ("gemini-2.5-pro", 4_096),
    ("gemini-3-flash-preview", 1_024),
    ("gemini-3-pro-preview", 4_096),
    ("gemini-3.1-pro-preview", 4_096),
    ("gemini-2.5-flash-lite", 4_096),  # not in Gemini's table: the largest documented
    ("gemini-2.0-flash", 4_096),
])
def test_gemini_models_carry_their_explicit_caching_minimum(model_id: str,
                                                            minimum: int) -> None:
    e = entry(model_id)
    assert e.min_cacheable_tokens == minimum
    assert e.provider_format == p.GEMINI_GENERATE_CONTENT
    assert (e.context_window, e.base_factor) == (1_048_576, 1.3)


def test_only_gemini_entries_have_a_minimum_and_the_about_cites_it() -> None:
    for e in DATA["models"]:
        assert ("min_cacheable_tokens" in e) == (e["provider"] == "google"), e["prefix"]
    assert "ai.google.dev/gemini-api/docs/caching" in DATA["about"]
    assert entry("claude-sonnet-4-5").min_cacheable_tokens == 0


def test_an_unknown_model_has_no_default_format() -> None:
    assert CATALOG.lookup("acme-16k") is None
    assert CATALOG.default_format("acme-16k") == ""


def _data(**extra: Any) -> dict[str, Any]:
    return {"models": [{"prefix": "m-", "provider": "x", "encoding": "cl100k_base",
                        "context_window": 1000, "output_reserve": 100,
                        "breakpoint_budget": 4, "base_factor": 1.0, **extra}]}


def test_the_new_keys_are_optional_and_validated() -> None:
    bare = ModelCatalog.from_data(_data()).lookup("m-1")
    assert bare is not None and bare.provider_format == "" and bare.min_cacheable_tokens == 0
    with pytest.raises(ValueError, match="provider_format 'gemini' is not one of"):
        ModelCatalog.from_data(_data(provider_format="gemini"))
    for bad in (-1, True, "1024"):
        with pytest.raises(ValueError, match="min_cacheable_tokens"):
            ModelCatalog.from_data(_data(min_cacheable_tokens=bad))
    assert bare.long_ttl is False
    assert ModelCatalog.from_data(_data(long_ttl=True)).lookup("m-1").long_ttl is True  # type: ignore[union-attr]
    for bad in (1, 0, "true", None):
        with pytest.raises(ValueError, match="long_ttl must be true or false"):
            ModelCatalog.from_data(_data(long_ttl=bad))
    with pytest.raises(TypeError):
        ModelCatalog.from_data(_data(default_format="anthropic_messages"))


# Model ids of OpenAI's shapes the catalog's prefixes do not start: a fine-tune
# (``ft:<base>:<org>:<suffix>:<id>``), ChatGPT's GPT-4o, gpt-oss under its Hugging Face name.
# Oracle: tiktoken's own model table, for the base model written out by hand (tiktoken reads
# ``ft:gpt-4.1...`` by its ``ft:gpt-4`` prefix as cl100k_base; gpt-4.1 is o200k_base).
@pytest.mark.parametrize(("model_id", "base", "window"), [
    ("ft:gpt-4o-2024-08-06:acme::9abcXYZ", "gpt-4o-2024-08-06", 128_000),
    ("ft:gpt-4o-mini-2024-07-18:acme:support:9abcXYZ", "gpt-4o-mini-2024-07-18", 128_000),
    ("ft:gpt-4.1-2025-04-14:acme::BxYz1234", "gpt-4.1-2025-04-14", 1_047_576),
    ("ft:gpt-3.5-turbo-0125:acme::8abc", "gpt-3.5-turbo-0125", 16_385),
    ("chatgpt-4o-latest", "chatgpt-4o-latest", 128_000),
    ("openai/gpt-oss-120b", "gpt-oss-120b", 131_072),
])
def test_openai_id_shapes_are_sized_as_their_base_model(model_id: str, base: str,
                                                         window: int) -> None:
    import tiktoken

    profile = CATALOG.resolve(model_id, context_window=None, output_reserve=None,
                              breakpoint_budget=None)
    assert (profile.provider, profile.encoding, profile.context_window, profile.base_factor) == (
        "openai", tiktoken.encoding_name_for_model(base), window, 1.0)
    assert profile.model_id == model_id  # the id sent is the caller's


# The -latest chat models (OpenAI's model pages): a 128,000-token window and 16,384 output
# tokens, as gpt-5-chat-latest, not gpt-5's 400,000 / 128,000.
@pytest.mark.parametrize("model_id", ["gpt-5-chat-latest", "gpt-5.1-chat-latest",
                                      "gpt-5.2-chat-latest"])
def test_the_chat_latest_models_have_a_128k_window(model_id: str) -> None:
    e = entry(model_id)
    assert (e.context_window, e.output_reserve, e.encoding) == (128_000, 16_384, "o200k_base")


def test_an_image_costs_the_models_own_figure_and_an_unknown_model_the_largest() -> None:
    """One flat 3,870 for every model under-counted gpt-4o-mini's images (2,833 + 5,667 a
    tile, 48,169 for 8 tiles); gpt-4o-mini has its own entry, sized as gpt-4o otherwise."""
    mini, four = entry("gpt-4o-mini-2024-07-18"), entry("gpt-4o")
    assert mini.prefix == "gpt-4o-mini" and mini.image_tokens == 2_833 + 8 * 5_667
    assert (mini.encoding, mini.context_window, mini.output_reserve, mini.provider_format) == (
        four.encoding, four.context_window, four.output_reserve, four.provider_format)
    assert CATALOG.image_tokens("gpt-4o") == 85 + 8 * 170
    assert CATALOG.image_tokens("some-unlisted-model") == max(
        e["image_tokens"] for e in DATA["models"]) == 48_169
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="image_tokens"):
            ModelCatalog.from_data({"models": [{**DATA["models"][0], "image_tokens": bad}]})


# A catalog entry's figures, held to what a Plan of its model can use when it loads (serve: a
# configuration error naming CE_MODEL_CATALOG), not found by each Plan: a quoted window failed
# every Plan INTERNAL (TypeError), a negative base factor INTERNAL (a negative prefix count the
# database refused), a negative window INVALID_ARGUMENT at the caller's output_reserve.
@pytest.mark.parametrize(("field", "bad"), [
    ("context_window", "200000"), ("context_window", 0), ("context_window", -5),
    ("context_window", True), ("context_window", 1000.0), ("context_window", 2**31),
    ("context_window", None),
    ("output_reserve", "100"), ("output_reserve", 0), ("output_reserve", -1),
    ("output_reserve", 1000), ("output_reserve", 5000),
    ("breakpoint_budget", -1), ("breakpoint_budget", "4"), ("breakpoint_budget", 1.5),
    ("breakpoint_budget", False), ("breakpoint_budget", 2**31),
    ("base_factor", -1.3), ("base_factor", 0), ("base_factor", 0.49), ("base_factor", 4.01),
    ("base_factor", float("nan")), ("base_factor", float("inf")), ("base_factor", "1.3"),
    ("base_factor", True), ("base_factor", None), ("base_factor", 1e300),
    ("min_cacheable_tokens", 2**31), ("image_tokens", 2**40),
    ("prefix", 5), ("provider", None), ("encoding", ["cl100k_base"]),
])
def test_an_entry_no_plan_could_use_is_refused_naming_its_field(field: str, bad: Any) -> None:
    with pytest.raises(ValueError, match=rf"model catalog entry .*: {field}\b") as caught:
        ModelCatalog.from_data(_data(**{field: bad}))
    if field != "prefix":
        assert str(caught.value).startswith("model catalog entry 'm-': ")


@pytest.mark.parametrize("fields", [
    {"breakpoint_budget": 0}, {"base_factor": 0.5}, {"base_factor": 4}, {"base_factor": 4.0},
    {"context_window": 2**31 - 1, "output_reserve": 2**31 - 2}, {"output_reserve": 999},
    {"min_cacheable_tokens": 2**31 - 1, "image_tokens": 2**31 - 1}])
def test_an_entry_at_the_bounds_is_taken_and_served(fields: dict[str, Any]) -> None:
    profile = ModelCatalog.from_data(_data(**fields)).resolve(
        "m-1", context_window=None, output_reserve=None, breakpoint_budget=None)
    assert {k: getattr(profile, k) for k in fields if hasattr(profile, k)} == {
        k: v for k, v in fields.items() if hasattr(profile, k)}


_FIGURES = st.one_of(st.integers(min_value=-10, max_value=2**32), st.booleans(), st.none(),
                     st.floats(allow_nan=True, allow_infinity=True),
                     st.integers(min_value=-10, max_value=10**6).map(str))


def _servable(e: dict[str, Any]) -> bool:
    """Written out here, sharing nothing with the catalog's own check: each figure as a
    request may give it (ModelCapabilities' int32s: a window and a reserve above 0, the
    reserve below the window, a breakpoint budget 0 or more) and a base factor within the
    correction factor's range, [0.5, 4.0]."""
    def whole(value: Any, least: int) -> bool:
        return type(value) is int and least <= value <= 2_147_483_647

    factor = e["base_factor"]
    return (whole(e["context_window"], 1) and whole(e["output_reserve"], 1)
            and whole(e["breakpoint_budget"], 0) and e["output_reserve"] < e["context_window"]
            and type(factor) in (int, float) and 0.5 <= factor <= 4.0)


@settings(max_examples=400, deadline=None)
@given(window=st.one_of(_FIGURES, st.integers(min_value=1, max_value=2**31 + 5)),
       reserve=st.one_of(_FIGURES, st.integers(min_value=1, max_value=300_000)),
       breakpoints=st.one_of(_FIGURES, st.integers(min_value=0, max_value=8)),
       factor=st.one_of(_FIGURES, st.floats(min_value=0.3, max_value=5)))
def test_a_catalog_that_loads_is_one_every_plan_can_use(window: Any, reserve: Any,
                                                        breakpoints: Any, factor: Any) -> None:
    """An entry loads exactly when its figures are servable; one that loads sizes a Plan
    without an error of the caller's, and leaves the correction factor a floor it can reach
    (at most 4.0), at which the estimate is no less than the tokenizer's own count."""
    fields = {"context_window": window, "output_reserve": reserve,
              "breakpoint_budget": breakpoints, "base_factor": factor}
    try:
        catalog = ModelCatalog.from_data(_data(**fields))
    except ValueError:
        assert not _servable({**_data()["models"][0], **fields})
        return
    assert _servable({**_data()["models"][0], **fields})
    profile = catalog.resolve("m-1", context_window=None, output_reserve=None,
                              breakpoint_budget=None)
    assert 0 < profile.output_reserve < profile.context_window < 2**31
    floor = least_factor(False, profile.base_factor)
    assert floor <= 4.0 and profile.base_factor * floor >= 1.0
