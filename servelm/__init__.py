"""servelm: an OpenAI-compatible LLM server with its own continuous-batching engine over llama.cpp."""

__version__ = "0.2.0"
