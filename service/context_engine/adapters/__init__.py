"""Adapters: PostgreSQL, tokenizers and file-backed assets behind the domain's ports."""
