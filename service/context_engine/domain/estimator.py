"""The token estimator port and the model catalog (ARCHITECTURE.md "The estimator and
reconciliation"; spec: "The token estimator").

The estimator is pure and conservative: counts come from a deterministic tokenizer, are
multiplied by the model's base factor and the request's correction factor, and round up.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from context_engine.domain.calibration import MAX_FACTOR, MIN_FACTOR
from context_engine.domain.canonical import reasoning_texts, sent_object_json
from context_engine.domain.errors import InvalidInput
from context_engine.domain.model import ModelProfile
from context_engine.domain.provider_formats import FORMATS, gemini_tool_name, sent_tool_names
from context_engine.domain.request import Attachment, AttachmentKind, Message, Role

# Provider chat framing per message (OpenAI cookbook: 3 per message, +1 per name; rounded up).
MESSAGE_OVERHEAD_TOKENS = 4
# Framing per tool definition beyond its name, description and schema JSON.
TOOL_OVERHEAD_TOKENS = 12
# Framing of the request itself (OpenAI cookbook): the system message that carries the prefix
# blocks (a message's framing, as above) and the primer of the reply (3). Counted once, with the
# prefix (plan.py).
REQUEST_OVERHEAD_TOKENS = MESSAGE_OVERHEAD_TOKENS + 3
# An opaque reasoning payload is counted at a token per three of its bytes at least (its
# base64 form, four characters per three bytes, at about four characters a token), or the
# count of the text it carries where that is more (``TokenEstimator._reasoning``).
REASONING_BYTES_PER_TOKEN = 3
# Beyond the name itself, what naming the function in a Gemini functionResponse may cost: the
# leading "_" a name starting with a digit, "-" or "." gets (provider_gemini.py).
RESPONSE_NAME_TOKENS = 1


# Attachments (ADR-0120): the adapter sends the file, so its estimate is added to its label.
# An attachment carries no dimensions (its kind, name, reference, a PDF's pages and a text
# file's inlined length), so an image is charged the largest documented cost of one image on
# the plan's model: the catalog's ``image_tokens`` (data/models.json, whose "about" names each
# provider's rule). A model the catalog does not know, and a catalog entry that states no
# figure, take the largest any catalog model documents: gpt-4o-mini's high detail, 2,833 +
# 5,667 a 512 px tile, 8 tiles at most (an image fits 2,048 px, its short side 768 px).
WORST_IMAGE_TOKENS = 2_833 + 8 * 5_667
# A PDF page: its text, up to 3,000 tokens (Anthropic's PDF support page: 1,500-3,000 a page),
# and the page as an image at the model's image figure, which Claude, OpenAI and Gemini read
# beside the text.
PDF_PAGE_TEXT_TOKENS = 3_000
# A text file: a token a UTF-8 byte when the sender states its bytes, an upper bound in any
# script (every token of a byte-level BPE, cl100k_base and o200k_base, covers a byte at least;
# English runs ~0.16 tokens a byte, emoji 0.73); else a token a character, the spec's figure,
# which prose in Latin, Cyrillic or common CJK stays under (CJK prose up to 1.06 tokens a
# character in cl100k_base) and emoji (2.9), rare CJK ideographs (2.37) and Georgian, Myanmar
# or Sinhala (2.0) exceed. The plan's base factor then applies, as to any text.
TEXT_TOKENS_PER_CHAR = 1
ATTACHMENT_BUDGET_TOKENS = 100_000  # request-wide cap on attachment content estimates
# The largest integer a catalog entry may hold: a request's ModelCapabilities are int32s.
CATALOG_INT_MAX = 2**31 - 1


def attachment_tokens(attachment: Attachment, base_factor: float = 1.0,
                      factor: float = 1.0, image_tokens: int = WORST_IMAGE_TOKENS) -> int:
    """Fixed estimate of an attachment's content: an image at ``image_tokens`` (the model's
    figure, ``TokenEstimator.image_tokens``), a PDF at that and 3,000 tokens of text a page; a
    text file at a token per inlined UTF-8 byte where the sender stated them, else a token per
    inlined character, times the base and correction factors as other text."""
    if attachment.kind is AttachmentKind.IMAGE:
        return image_tokens
    if attachment.kind is AttachmentKind.PDF:
        return (PDF_PAGE_TEXT_TOKENS + image_tokens) * max(1, attachment.pages)
    units = attachment.text_bytes or attachment.text_chars * TEXT_TOKENS_PER_CHAR
    return math.ceil(units * base_factor * factor)


class TokenCounter(Protocol):
    """Counts tokens of text with one encoding. Must be a pure function of the text."""

    @property
    def name(self) -> str:
        """A label of the tokenizer actually used (may name a fallback)."""
        ...

    @property
    def encoding(self) -> str:
        """The encoding actually loaded (e.g. cl100k_base for a fallback)."""
        ...

    def count(self, text: str) -> int: ...


class TokenizerRegistry(Protocol):
    def counter_for(self, encoding: str) -> tuple[TokenCounter, float]:
        """The counter for ``encoding`` and an extra factor (>= 1.0) that keeps a fallback
        tokenizer conservative; 1.0 when the encoding itself was loaded. Used at Plan time."""
        ...

    def exact(self, encoding: str) -> TokenCounter | None:
        """Exactly the encoding a plan pinned, or None if it cannot be loaded here."""
        ...


@dataclass(frozen=True, kw_only=True, slots=True)
class CatalogEntry:
    prefix: str
    provider: str
    encoding: str
    context_window: int
    output_reserve: int
    breakpoint_budget: int
    base_factor: float
    # The provider body Build renders when a request names none ("": none). Not part of the
    # pinned plan: read from the catalog at Plan response and Build time.
    provider_format: str = ""
    # Gemini's documented minimum for an explicit cached content (0: not a Gemini model).
    min_cacheable_tokens: int = 0
    # The largest documented cost of one image on the models the prefix matches (an
    # attachment carries no dimensions); an entry that states none takes the largest of all.
    image_tokens: int = WORST_IMAGE_TOKENS
    # The model takes a one-hour cachePoint ttl on Bedrock; without it a Bedrock body sends the
    # five-minute default (the Anthropic API takes 1h on every current Claude: its entries need
    # none). Not part of the pinned plan: read from the catalog at Build time.
    long_ttl: bool = False

    def __post_init__(self) -> None:
        """Every field as the service uses it, so that a catalog it cannot serve is refused
        when it loads (``serve``: a configuration error naming CE_MODEL_CATALOG), not by each
        Plan of the model: a quoted window failed them INTERNAL (TypeError), a negative base
        factor INTERNAL (a negative prefix count PostgreSQL refuses), a negative window
        INVALID_ARGUMENT, blaming the caller's request."""
        for name in ("prefix", "provider", "encoding"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"model catalog entry {self.prefix!r}: {name} must be a "
                                 f"string, not {getattr(self, name)!r}")
        if self.provider_format and self.provider_format not in FORMATS:
            raise ValueError(f"model catalog entry {self.prefix!r}: provider_format "
                             f"{self.provider_format!r} is not one of {', '.join(FORMATS)}")
        # the integers within what a request may set them to (ModelCapabilities' int32s: a
        # window and a reserve positive, a breakpoint budget 0 or more); an image's cost and
        # Gemini's minimum held to the same 32 bits
        for name, least in (("context_window", 1), ("output_reserve", 1),
                            ("breakpoint_budget", 0), ("min_cacheable_tokens", 0),
                            ("image_tokens", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) \
                    or not least <= value <= CATALOG_INT_MAX:
                raise ValueError(f"model catalog entry {self.prefix!r}: {name} must be an "
                                 f"integer from {least} to {CATALOG_INT_MAX}, not {value!r}")
        if self.output_reserve >= self.context_window:
            raise ValueError(f"model catalog entry {self.prefix!r}: output_reserve "
                             f"{self.output_reserve} leaves nothing of context_window "
                             f"{self.context_window}")
        factor = self.base_factor
        if not isinstance(factor, int | float) or isinstance(factor, bool) \
                or not MIN_FACTOR <= factor <= MAX_FACTOR:  # NaN compares false: refused
            raise ValueError(f"model catalog entry {self.prefix!r}: base_factor must be a "
                             f"number from {MIN_FACTOR} to {MAX_FACTOR} (the range of the "
                             f"estimator's correction factor, which it multiplies), not "
                             f"{factor!r}")
        if not isinstance(self.long_ttl, bool):
            raise ValueError(f"model catalog entry {self.prefix!r}: long_ttl must be true or "
                             "false")


# A model id's namespace that names no other model: gpt-oss as Hugging Face, vLLM and
# OpenRouter name it (``openai/gpt-oss-120b``).
_NAMESPACES = ("openai/",)


def base_model_id(model_id: str) -> str:
    """The id the catalog sizes ``model_id`` by: an OpenAI fine-tune,
    ``ft:<base model>:<organization>:<suffix>:<job id>``, is its base model (as tiktoken's
    ``encoding_for_model`` reads ``ft:gpt-4o...``), and ``openai/`` is dropped."""
    if model_id.startswith("ft:"):
        return model_id[3:].split(":", 1)[0]
    for namespace in _NAMESPACES:
        if model_id.startswith(namespace):
            return model_id[len(namespace):]
    return model_id


class ModelCatalog:
    """Maps model id prefixes to sizing; the longest matching prefix wins, matched against
    ``base_model_id`` (a fine-tune is sized as its base model)."""

    def __init__(self, entries: Sequence[CatalogEntry]) -> None:
        self._entries = sorted(entries, key=lambda e: (-len(e.prefix), e.prefix))

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> ModelCatalog:
        return cls([CatalogEntry(**e) for e in data["models"]])

    def default_format(self, model_id: str) -> str:
        """The provider body of a model whose Build request names none ("" for none)."""
        entry = self.lookup(model_id)
        return entry.provider_format if entry else ""

    def lookup(self, model_id: str) -> CatalogEntry | None:
        base = base_model_id(model_id)
        for entry in self._entries:
            if base.startswith(entry.prefix):
                return entry
        return None

    def image_tokens(self, model_id: str) -> int:
        """What one image attachment costs at most on ``model_id``: its entry's figure, or for a
        model the catalog does not know, the largest of them all (and of WORST_IMAGE_TOKENS)."""
        entry = self.lookup(model_id)
        if entry is not None:
            return entry.image_tokens
        return max((WORST_IMAGE_TOKENS, *(e.image_tokens for e in self._entries)))

    def family(self, model_id: str) -> str:
        """The model's metric label: the catalog prefix that matched, or ``unknown``."""
        return _family(self.lookup(model_id))

    def families(self) -> tuple[str, ...]:
        """Every value ``family`` can take (the metrics create a series for each at start)."""
        return tuple(sorted({_family(e) for e in self._entries} | {_family(None)}))

    def encodings(self) -> tuple[str, ...]:
        """Every encoding a Plan can pin from this catalog (cl100k_base: a model it does not
        know)."""
        return tuple(sorted({e.encoding for e in self._entries} | {"cl100k_base"}))

    def resolve(self, model_id: str, *, context_window: int | None,
                output_reserve: int | None, breakpoint_budget: int | None) -> ModelProfile:
        """Fill what the caller did not give from the catalog; a model the catalog does not know
        must come with its window."""
        entry = self.lookup(model_id)
        if entry is None and context_window is None:
            raise InvalidInput.one(
                "model.model_id",
                f"model {model_id!r} is not in the catalog; pass capabilities.context_window")
        window = context_window if context_window is not None else entry.context_window  # type: ignore[union-attr]
        reserve = output_reserve if output_reserve is not None else (
            entry.output_reserve if entry else 8192)
        breakpoints = breakpoint_budget if breakpoint_budget is not None else (
            entry.breakpoint_budget if entry else 4)
        if reserve >= window:
            raise InvalidInput.one("model.capabilities.output_reserve",
                                   f"output reserve {reserve} leaves nothing of window {window}")
        return ModelProfile(
            model_id=model_id,
            provider=entry.provider if entry else "unknown",
            encoding=entry.encoding if entry else "cl100k_base",
            context_window=window, output_reserve=reserve, breakpoint_budget=breakpoints,
            # an unknown model counts conservatively, like Claude: no public tokenizer
            base_factor=entry.base_factor if entry else 1.3,
            family=_family(entry),
        )


def _family(entry: CatalogEntry | None) -> str:
    return entry.prefix.rstrip("-") if entry else "unknown"


class TokenEstimator:
    """Per-model, conservative, pure. ``factor`` is the calibration correction (an explicit
    input: the response echoes it and a request may pin it)."""

    def __init__(self, counter: TokenCounter, base_factor: float, label: str = "",
                 image_tokens: int | Callable[[], int] = WORST_IMAGE_TOKENS) -> None:
        self._counter = counter
        self.base_factor = base_factor
        self._label = label or counter.name
        # the model's image figure, or how to find it (the catalog's, looked up only when a
        # request has attachments: a Build without any never reads it)
        self._images = image_tokens

    @property
    def image_tokens(self) -> int:
        """What one image attachment costs at most on the plan's model (``attachment_tokens``)."""
        images = self._images
        if not isinstance(images, int):
            images = self._images = images()
        return images

    @property
    def tokenizer(self) -> str:
        return self._label

    @property
    def encoding(self) -> str:
        return self._counter.encoding

    def text(self, text: str, factor: float = 1.0) -> int:
        if not text:
            return 0
        return math.ceil(self._counter.count(text) * self.base_factor * factor)

    def raw(self, message: Message) -> int:
        """The tokenizer's count of everything the message sends, before any factor: its text,
        each call's id, name and arguments with 3 tokens of framing, the call id a tool result
        answers, and a reasoning payload; counted as the costliest provider body sends them.
        A tool result's text counts as the JSON value ``{"output": text}`` where that is more
        (Gemini's ``functionResponse``: its key, quotes, and every quote, backslash and line
        break escaped), and each call pays its name a second time and one token more
        (Gemini's response names the function it answers, with a leading "_" where the name
        needs one): counted with the call, since a call and its result are never apart."""
        if message.role is Role.TOOL and message.text:
            raw = max(self._counter.count(message.text),
                      self._counter.count(json.dumps({"output": message.text},
                                                     ensure_ascii=False, separators=(",", ":"))))
        else:
            raw = self._counter.count(message.text) if message.text else 0
        for call in message.tool_calls:
            raw += self._name(call.name) + self._arguments(call.arguments_json) + 3
            raw += self._counter.count(call.call_id)
            raw += max(self._counter.count(call.name) + RESPONSE_NAME_TOKENS,
                       self._counter.count(gemini_tool_name(call.name)))
        if message.call_id:
            raw += self._counter.count(message.call_id)
        if message.reasoning_opaque:
            raw += self._reasoning(message.reasoning_opaque)
        return raw

    def _name(self, name: str) -> int:
        """A tool name in its costliest sent form (each "." sent as "__", a leading "_" for
        Gemini where the name needs one: provider_formats.py)."""
        return max(self._counter.count(form) for form in sent_tool_names(name))

    def _arguments(self, text: str) -> int:
        """A call's arguments as the costlier of their two sent forms: verbatim (OpenAI sends
        the string) and as the parsed object re-serialized (Anthropic, Gemini and Bedrock send
        ``input``/``args``, so ``1e15`` arrives as ``1000000000000000.0`` and ``\\u00e9`` as
        ``é``)."""
        raw = self._counter.count(text)
        sent = sent_object_json(text)
        if sent != text:
            raw = max(raw, self._counter.count(sent))
        return raw

    def _reasoning(self, opaque: bytes) -> int:
        """A reasoning payload: its bytes / REASONING_BYTES_PER_TOKEN, or where more, the
        tokenizer's count of the text it carries (Anthropic ``thinking``, Bedrock
        ``reasoningText``, OpenAI summary ``text``: what the provider reads as tokens; text of
        rare characters costs up to a token a byte)."""
        by_bytes = math.ceil(len(opaque) / REASONING_BYTES_PER_TOKEN)
        texts = reasoning_texts(opaque)
        return max(by_bytes, sum(self._counter.count(t) for t in texts)) if texts else by_bytes

    def scaled(self, raw: int, factor: float = 1.0) -> int:
        """A message's estimate from its raw count: the base factor on the count, the
        correction factor on all of it (framing included: the body scales as a whole, which
        is what reconciliation measures), rounded up."""
        return math.ceil((raw * self.base_factor + MESSAGE_OVERHEAD_TOKENS) * factor)

    def message(self, message: Message, factor: float = 1.0) -> int:
        return self.scaled(self.raw(message), factor)

    def messages(self, messages: Sequence[Message], factor: float = 1.0) -> int:
        return sum(self.message(m, factor) for m in messages)
