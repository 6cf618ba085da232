"""POST /v1/embeddings wire shapes (OpenAI's, plus Databricks' `instruction`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ValidationError, ValidatorFunctionWrapHandler, field_validator
from pydantic_core import PydanticCustomError

from servelm.protocol.common import Int32, KeepAlive, PositiveCount, ResponseModel, WireModel


class EmbeddingRequest(WireModel):
    model: str
    # a text, texts, one input as token ids, or several inputs as token ids
    input: str | list[str] | list[Int32] | list[list[Int32]]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: PositiveCount | None = None
    keep_alive: KeepAlive | None = None  # Ollama's: how long a model loaded on demand stays loaded
    user: str | None = None
    instruction: str | None = None  # Databricks: prepended to every text input

    @field_validator("input", mode="wrap")
    @classmethod
    def _one_input_form(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """One clear message instead of the first of four union members' complaints."""
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError(
                "input_type", "expected a string, an array of strings, an array of token ids (integers), "
                "or an array of arrays of token ids (integers within ±2^31)",
            ) from None


class Embedding(ResponseModel):
    object: str = "embedding"
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32 values


class EmbeddingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(ResponseModel):
    id: str  # Databricks returns one; OpenAI's clients ignore it
    object: str = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
