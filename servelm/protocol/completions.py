"""Legacy Completions wire shapes (OpenAI's, with vLLM's and Databricks' extensions)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from servelm.protocol.common import GenerationFields, Int32, ResponseModel, Usage

TokenIds = list[Int32]


class CompletionRequest(GenerationFields):
    # one prompt (text or token ids) or a batch of them; emptiness and the vocabulary are checked in service/
    prompt: str | list[str] | TokenIds | list[TokenIds]
    suffix: str | None = None  # fill-in-the-middle: the text that follows the completion
    echo: bool | None = None  # the prompt comes back ahead of each choice's text
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # legacy: alternatives per token (0: the token's own)
    use_raw_prompt: bool | None = None  # Databricks: the text's own tokens, nothing added or parsed
    error_behavior: Literal["truncate", "error"] | None = None  # Databricks: a prompt too long is cut or a 400


class CompletionLogprobs(ResponseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class Completion(ResponseModel):
    """The whole answer, and (streamed) each chunk of it: both are "text_completion" objects."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None
