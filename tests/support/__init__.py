"""Test support: a fake Anthropic prompt cache and a runtime-like driver over the real stub."""
