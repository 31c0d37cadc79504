"""The provider body formats by name (``BuildRequest.provider_format``, the catalog's
``provider_format``). A module of its own, importing nothing, so the model catalog can check
its entries against it without importing the renderers."""

from __future__ import annotations

ANTHROPIC_MESSAGES = "anthropic_messages"
OPENAI_RESPONSES = "openai_responses"
OPENAI_CHAT_COMPLETIONS = "openai_chat_completions"
GEMINI_GENERATE_CONTENT = "gemini_generate_content"
BEDROCK_CONVERSE = "bedrock_converse"
FORMATS = (ANTHROPIC_MESSAGES, OPENAI_RESPONSES, OPENAI_CHAT_COMPLETIONS,
           GEMINI_GENERATE_CONTENT, BEDROCK_CONVERSE)
