"""Test support: a fake Anthropic prompt cache (cache_sim), a runtime-like driver over the real
stub (runtime), prompt-injection attacks and an independent envelope parser (attacks,
envelope_parser), fuzzing strategies (fuzz), certificates made with openssl (certs) and a
loopback OpenAI-compatible summarizer (fake_llm)."""
