"""Wire shapes shared by every endpoint."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class WireModel(BaseModel):
    """A request body: strict types (no "1" for 1, no true for 1.0) and no unknown fields."""

    model_config = ConfigDict(strict=True, extra="forbid")


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ModelCard(ResponseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "servelm"
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: str = "list"
    data: list[ModelCard]
