"""Which provider body Build renders: the asked format, the model's default from the catalog
when none is asked (UNSPECIFIED), none for NONE or a model the catalog gives no format; what
``BuildResponse.provider_format`` and ``gemini_cached_content`` say; and the plan's
``default_provider_format``. Every format of the contract is mapped, rendered and validated."""

from __future__ import annotations

import hashlib
import json

import pytest
from context_engine.api import mapping
from context_engine.domain import providers as p
from context_engine.domain.estimator import CatalogEntry, ModelCatalog
from context_engine.v1 import context_engine_pb2 as pb

from tests import factories as f
from tests.unit.test_providers import CATALOG, built, two_runs

CONTRACT_FORMATS = set(pb.ProviderFormat.values()) - {pb.PROVIDER_FORMAT_UNSPECIFIED,
                                                     pb.PROVIDER_FORMAT_NONE}


def test_every_format_of_the_contract_is_mapped_rendered_and_validated() -> None:
    assert set(mapping.FORMAT_FROM_PB) == CONTRACT_FORMATS
    assert set(mapping.FORMAT_FROM_PB.values()) == set(p.FORMATS)
    assert {mapping.FORMAT_TO_PB[n] for n in p.FORMATS} == CONTRACT_FORMATS
    assert set(p.RENDERERS) == set(p.VALIDATORS) == set(p.FORMATS)
    assert len(set(p.FORMATS)) == 5
    assert (p.OPENAI_CHAT_COMPLETIONS, p.GEMINI_GENERATE_CONTENT, p.BEDROCK_CONVERSE) == (
        "openai_chat_completions", "gemini_generate_content", "bedrock_converse")


def test_requested_formats() -> None:
    v = mapping.Violations()
    assert mapping.requested_provider_format(v, pb.PROVIDER_FORMAT_UNSPECIFIED) \
        == mapping.MODEL_DEFAULT_FORMAT
    assert mapping.requested_provider_format(v, pb.PROVIDER_FORMAT_NONE) == ""
    for value, name in mapping.FORMAT_FROM_PB.items():
        assert mapping.requested_provider_format(v, value) == name
    assert not v.items
    assert mapping.requested_provider_format(v, 9) == ""  # type: ignore[arg-type]
    assert [i.field for i in v.items] == ["provider_format"]


@pytest.mark.parametrize(("model_id", "fmt"), [
    ("claude-sonnet-4-5", p.ANTHROPIC_MESSAGES),
    ("gpt-5", p.OPENAI_RESPONSES),
    ("gpt-4o", p.OPENAI_RESPONSES),
    ("gpt-oss-120b", p.OPENAI_CHAT_COMPLETIONS),
    ("gemini-2.5-flash", p.GEMINI_GENERATE_CONTENT),
    ("anthropic.claude-sonnet-4-5-20250929-v1:0", p.BEDROCK_CONVERSE),
    ("global.anthropic.claude-sonnet-4-5-20250929-v1:0", p.BEDROCK_CONVERSE),
])
def test_without_a_format_build_renders_the_models_default(model_id: str, fmt: str) -> None:
    r = built(two_runs(), model_id=model_id)
    out = mapping.build_pb(r, mapping.MODEL_DEFAULT_FORMAT)
    assert out.provider_format == mapping.FORMAT_TO_PB[fmt]
    assert json.loads(out.provider_body_json) == p.render(r, fmt)
    assert out.HasField("gemini_cached_content") == (fmt == p.GEMINI_GENERATE_CONTENT)
    explicit = mapping.build_pb(r, fmt)
    assert explicit == out  # the default is exactly the asked format's answer


def test_none_and_an_unknown_model_render_no_body() -> None:
    r = built(two_runs())
    for out in (mapping.build_pb(r), mapping.build_pb(r, "")):
        assert out.provider_body_json == ""
        assert out.provider_format == pb.PROVIDER_FORMAT_UNSPECIFIED
        assert not out.HasField("gemini_cached_content")
    i = f.inputs(enabled=tuple(t.name for t in CATALOG), catalog=CATALOG,
                 model_profile=f.model("acme-16k", context_window=16_000))
    unknown = f.run_build(f.loaded(i), f.checkpoint(two_runs()))
    out = mapping.build_pb(unknown, mapping.MODEL_DEFAULT_FORMAT)
    assert out.provider_body_json == "" and out.provider_format == pb.PROVIDER_FORMAT_UNSPECIFIED
    asked = mapping.build_pb(unknown, p.OPENAI_CHAT_COMPLETIONS)  # any model, when asked
    assert asked.provider_format == pb.PROVIDER_FORMAT_OPENAI_CHAT_COMPLETIONS


def test_an_asked_format_overrides_the_default_and_the_body_is_canonical() -> None:
    r = built(two_runs(), model_id="claude-sonnet-4-5")
    for fmt in p.FORMATS:
        out = mapping.build_pb(r, fmt)
        assert out.provider_format == mapping.FORMAT_TO_PB[fmt]
        text = out.provider_body_json
        assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"),
                                  ensure_ascii=False)
        assert p.validate(json.loads(text), fmt) == []


def test_the_catalog_passed_in_decides_the_default() -> None:
    r = built(two_runs(), model_id="claude-sonnet-4-5")
    own = ModelCatalog([CatalogEntry(prefix="claude-", provider="anthropic",
                                     encoding="cl100k_base", context_window=200_000,
                                     output_reserve=8_192, breakpoint_budget=4,
                                     base_factor=1.3, provider_format=p.BEDROCK_CONVERSE)])
    out = mapping.build_pb(r, mapping.MODEL_DEFAULT_FORMAT, catalog=own)
    assert out.provider_format == pb.PROVIDER_FORMAT_BEDROCK_CONVERSE
    bare = ModelCatalog([CatalogEntry(prefix="claude-", provider="anthropic",
                                      encoding="cl100k_base", context_window=200_000,
                                      output_reserve=8_192, breakpoint_budget=4,
                                      base_factor=1.3)])
    assert mapping.build_pb(r, mapping.MODEL_DEFAULT_FORMAT, catalog=bare).provider_body_json \
        == ""


def test_a_gemini_body_comes_with_its_cached_content() -> None:
    r = built(two_runs(), model_id="gemini-2.5-flash")
    out = mapping.build_pb(r, p.GEMINI_GENERATE_CONTENT)
    body = json.loads(out.provider_body_json)
    cached = out.gemini_cached_content
    tag = hashlib.sha256(f"{r.session_key}:{r.prefix_sha256}".encode()).hexdigest()[:16]
    assert cached.display_name == f"ce-{tag}-e{r.epoch}"
    assert cached.ttl == "300s"
    assert list(cached.holds) == ["systemInstruction", "tools"]
    assert cached.min_cacheable_tokens == 1_024  # the catalog's, for 2.5 Flash
    assert cached.estimated_tokens == r.prefix_tokens
    create = json.loads(cached.create_body_json)
    assert create["model"] == "models/gemini-2.5-flash" and create["ttl"] == "300s"
    assert create["systemInstruction"] == body["systemInstruction"]
    cached_body = json.loads(cached.cached_body_json)
    assert {**cached_body, "systemInstruction": body["systemInstruction"],
            "tools": body["tools"]} == body
    # a Gemini body for a model the catalog gives no minimum: Gemini's largest
    other = mapping.build_pb(built(two_runs(), model_id="claude-sonnet-4-5"),
                             p.GEMINI_GENERATE_CONTENT)
    assert other.gemini_cached_content.min_cacheable_tokens == 4_096


@pytest.mark.parametrize(("model_id", "value"), [
    ("claude-sonnet-4-5", pb.PROVIDER_FORMAT_ANTHROPIC_MESSAGES),
    ("gpt-5", pb.PROVIDER_FORMAT_OPENAI_RESPONSES),
    ("gemini-2.5-pro", pb.PROVIDER_FORMAT_GEMINI_GENERATE_CONTENT),
    ("eu.anthropic.claude-sonnet-4-5-20250929-v1:0", pb.PROVIDER_FORMAT_BEDROCK_CONVERSE),
])
def test_the_plan_names_the_models_default_format(model_id: str,
                                                  value: pb.ProviderFormat.ValueType) -> None:
    loaded = f.loaded(f.inputs(model_profile=f.model(model_id)))
    assert mapping.plan_pb(loaded).default_provider_format == value
    # derived, not pinned: the plan's spec does not hold it
    assert "provider_format" not in json.dumps(loaded.plan.spec.model.canonical())


def test_a_plan_for_a_model_without_a_default_says_unspecified() -> None:
    loaded = f.loaded(f.inputs(model_profile=f.model("acme-16k", context_window=16_000)))
    assert mapping.plan_pb(loaded).default_provider_format == pb.PROVIDER_FORMAT_UNSPECIFIED
