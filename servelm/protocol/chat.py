"""Chat Completions wire shapes (OpenAI's, with vLLM's and the seeds' extensions)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from servelm.protocol.common import ResponseModel, Usage, WireModel

Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class TextPart(WireModel):
    type: Literal["text"]
    text: str


class ImageURL(WireModel):
    url: str
    detail: str | None = None


class ImagePart(WireModel):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(WireModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required")
        return self


class StreamOptions(WireModel):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class ResponseFormat(WireModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(WireModel):
    model: str
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    # sampling
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Probability | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Probability | None = None
    seed: int | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    # stopping
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    # output
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # parts of the contract that later work adds; accepted here only in their neutral form
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class ChatMessageOut(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class Choice(ResponseModel):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: Any = None


class ChatCompletion(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[Choice]
    usage: Usage


class Delta(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(ResponseModel):
    index: int
    delta: Delta
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: Any = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChunkChoice]
    usage: Usage | None = None
