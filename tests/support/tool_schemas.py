"""A tool input schema as pydantic generates one (a ``title`` on the model, on every field and
on nested definitions, ``default: null`` on optional fields, ``[]`` and ``{}`` defaults), with
titles a person wrote beside them (a property's title that says more than its name, titles at
places no generator titles: an alternative, an array's items, a map's values, a definition
titled other than its key) and the traps a careless stripper falls into: properties named
``title`` and ``default``, a ``title`` inside data (``enum``, ``examples``, a non-empty
``default``), falsy but meaningful defaults (``0``, ``false``) and a definition named
``title``. ``PROVIDER_FORM`` is what provider bodies must send, written out by hand (spec:
"Provider serialization omits redundant generated titles and empty default annotations while
retaining every validation keyword and meaningful non-empty default"); ``ALL_TITLES_DROPPED``
what they send for a plan pinned before builder@9, which dropped every title."""

from __future__ import annotations

from typing import Any

GENERATED: dict[str, Any] = {
    "title": "SearchArgs",
    "description": "Arguments of web.search.",
    "type": "object",
    "properties": {
        "title": {"title": "Title", "type": "string", "description": "Match the page title."},
        "default": {"title": "Default", "type": "string"},
        "query": {"title": "Query", "type": "string", "minLength": 1, "maxLength": 200},
        "limit": {"title": "Limit", "type": "integer", "default": 10, "minimum": 1},
        "offset": {"title": "Offset", "type": "integer", "default": 0},
        "exact": {"title": "Exact", "type": "boolean", "default": False},
        "lang": {"anyOf": [{"title": "Code", "type": "string", "pattern": "^[a-z]{2}$"},
                           {"type": "null"}], "default": None, "title": "Lang"},
        "tags": {"title": "Tags", "type": "array", "default": [],
                 "items": {"title": "Tag", "type": "string"}},
        "filters": {"title": "Filters", "type": "object", "default": {},
                    "additionalProperties": {"title": "Filter", "type": "string"}},
        "note": {"type": "string", "default": ""},
        "sort": {"$ref": "#/$defs/Sort", "default": "relevance"},
        "shape": {"enum": [{"title": "kept: data"}], "default": {"title": "kept: data"}},
        "user_id": {"title": "User Id", "type": "string"},
        "to": {"title": "Recipient e-mail address (never a name)", "type": "string"},
    },
    "required": ["title", "query"],
    "additionalProperties": False,
    "$defs": {"Sort": {"title": "Sort", "type": "string", "enum": ["relevance", "date"]},
              "title": {"title": "A definition named title", "type": "object"}},
    "examples": [{"title": "kept: data", "query": "q"}],
}

PROVIDER_FORM: dict[str, Any] = {
    "description": "Arguments of web.search.",
    "type": "object",
    "properties": {
        "title": {"type": "string", "description": "Match the page title."},
        "default": {"type": "string"},
        "query": {"type": "string", "minLength": 1, "maxLength": 200},
        "limit": {"type": "integer", "default": 10, "minimum": 1},
        "offset": {"type": "integer", "default": 0},
        "exact": {"type": "boolean", "default": False},
        "lang": {"anyOf": [{"title": "Code", "type": "string", "pattern": "^[a-z]{2}$"},
                           {"type": "null"}]},
        "tags": {"type": "array", "items": {"title": "Tag", "type": "string"}},
        "filters": {"type": "object",
                    "additionalProperties": {"title": "Filter", "type": "string"}},
        "note": {"type": "string"},
        "sort": {"$ref": "#/$defs/Sort", "default": "relevance"},
        "shape": {"enum": [{"title": "kept: data"}], "default": {"title": "kept: data"}},
        "user_id": {"type": "string"},
        "to": {"title": "Recipient e-mail address (never a name)", "type": "string"},
    },
    "required": ["title", "query"],
    "additionalProperties": False,
    "$defs": {"Sort": {"type": "string", "enum": ["relevance", "date"]},
              "title": {"title": "A definition named title", "type": "object"}},
    "examples": [{"title": "kept: data", "query": "q"}],
}

ALL_TITLES_DROPPED: dict[str, Any] = {
    "description": "Arguments of web.search.",
    "type": "object",
    "properties": {
        "title": {"type": "string", "description": "Match the page title."},
        "default": {"type": "string"},
        "query": {"type": "string", "minLength": 1, "maxLength": 200},
        "limit": {"type": "integer", "default": 10, "minimum": 1},
        "offset": {"type": "integer", "default": 0},
        "exact": {"type": "boolean", "default": False},
        "lang": {"anyOf": [{"type": "string", "pattern": "^[a-z]{2}$"}, {"type": "null"}]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "filters": {"type": "object", "additionalProperties": {"type": "string"}},
        "note": {"type": "string"},
        "sort": {"$ref": "#/$defs/Sort", "default": "relevance"},
        "shape": {"enum": [{"title": "kept: data"}], "default": {"title": "kept: data"}},
        "user_id": {"type": "string"},
        "to": {"type": "string"},
    },
    "required": ["title", "query"],
    "additionalProperties": False,
    "$defs": {"Sort": {"type": "string", "enum": ["relevance", "date"]},
              "title": {"type": "object"}},
    "examples": [{"title": "kept: data", "query": "q"}],
}
