"""servelm: an OpenAI-compatible LLM server with its own continuous-batching engine over llama.cpp."""

__version__ = "0.1.0"
