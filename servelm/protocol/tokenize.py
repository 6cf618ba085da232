"""POST /tokenize and /detokenize in vLLM's shapes, with llama-server's field names accepted too."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from servelm.protocol.chat import ChatMessage, Tool
from servelm.protocol.common import MAX_MESSAGES, Count, ResponseModel, WireModel


class TokenizeRequest(WireModel):
    model: str | None = None  # the only text model when left out
    prompt: str | None = None
    content: str | None = None  # llama-server's name for prompt
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    add_special_tokens: bool | None = None
    add_special: bool | None = None  # llama-server's name for add_special_tokens
    parse_special: bool | None = None  # llama-server's: special-token text in the prompt is read as those tokens
    return_token_strs: bool | None = None
    with_pieces: bool | None = None  # llama-server's: each token as {id, piece}

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        given = [n for n in ("prompt", "content", "messages") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of prompt (or content) and messages")
        return self


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int] | list[dict[str, Any]]
    token_strs: list[str] | None = None


class DetokenizeRequest(WireModel):
    model: str | None = None
    tokens: list[Count]


class DetokenizeResponse(ResponseModel):
    prompt: str
    content: str  # llama-server's name
