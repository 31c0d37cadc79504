"""context-engine: assembles the model requests of LLM agent runtimes."""

__version__ = "0.1.0"
