"""The provider body formats by name (``BuildRequest.provider_format``, the catalog's
``provider_format``). A module of its own, importing nothing, so the model catalog can check
its entries against it without importing the renderers; and the tool-name forms bodies send,
which the estimator and the plan count."""

from __future__ import annotations

ANTHROPIC_MESSAGES = "anthropic_messages"
OPENAI_RESPONSES = "openai_responses"
OPENAI_CHAT_COMPLETIONS = "openai_chat_completions"
GEMINI_GENERATE_CONTENT = "gemini_generate_content"
BEDROCK_CONVERSE = "bedrock_converse"
FORMATS = (ANTHROPIC_MESSAGES, OPENAI_RESPONSES, OPENAI_CHAT_COMPLETIONS,
           GEMINI_GENERATE_CONTENT, BEDROCK_CONVERSE)


def provider_tool_name(name: str) -> str:
    """Our tool name as providers accept it: "." becomes "__"."""
    return name.replace(".", "__")


def gemini_tool_name(name: str) -> str:
    """Our tool name as Gemini takes it: as it is, or with a leading "_" when it does not
    start with a letter or an underscore."""
    return name if name[:1].isascii() and (name[:1].isalpha() or name[:1] == "_") \
        else "_" + name


def sent_tool_names(name: str) -> tuple[str, ...]:
    """Every form in which some provider body sends the tool name ``name``."""
    return tuple(dict.fromkeys((name, provider_tool_name(name), gemini_tool_name(name))))
