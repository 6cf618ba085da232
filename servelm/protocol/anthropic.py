"""Anthropic's Messages API wire shapes (POST /v1/messages, its stream events, /v1/messages/count_tokens)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from servelm.protocol.chat import FunctionName
from servelm.protocol.common import (
    MAX_MESSAGES,
    MAX_PARTS,
    MAX_TOOLS,
    Count,
    NamedEvent,
    PositiveCount,
    Priority,
    Probability,
    ResponseModel,
    Seed,
    WireModel,
)


class CacheControl(WireModel):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(WireModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None


class ToolUseBlock(WireModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(WireModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(WireModel):
    """An earlier answer's thinking, resent: not shown to the model again (as Anthropic drops it). As on Anthropic's
    API, a thinking block carries its text and its signature (as it came back: servelm's are empty strings), a
    redacted one its data."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None

    @model_validator(mode="after")
    def _complete(self) -> ThinkingBlock:
        if self.type == "thinking" and (self.thinking is None or self.signature is None):
            raise ValueError("a thinking block needs its `thinking` and its `signature`, as the answer gave them")
        if self.type == "redacted_thinking" and self.data is None:
            raise ValueError("a redacted_thinking block needs its `data`")
        return self


class MediaBlock(WireModel):
    """Images and documents: recognised so that the answer can say this model takes text only."""

    model_config = WireModel.model_config | {"extra": "allow"}
    type: Literal["image", "document", "search_result"]


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | MediaBlock,
                         Field(discriminator="type")]


class Message(WireModel):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlock], Field(min_length=1, max_length=MAX_PARTS)]


class CustomTool(WireModel):
    type: Literal["custom"] | None = None
    name: FunctionName
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class ServerTool(WireModel):
    """A tool Anthropic runs itself (web search, code execution…): not served here; ignored with a warning."""

    model_config = WireModel.model_config | {"extra": "allow"}
    type: str
    name: str


def _tool_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "custom" if kind in (None, "custom") else "server"


ToolParam = Annotated[Annotated[CustomTool, Tag("custom")] | Annotated[ServerTool, Tag("server")],
                      Discriminator(_tool_tag)]


class ToolChoice(WireModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingParam(WireModel):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: PositiveCount | None = None
    display: Literal["summarized", "omitted"] | None = None


class JsonOutputFormat(WireModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(WireModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class CountTokensRequest(WireModel):
    model: str
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[ToolParam], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None  # the earlier name of output_config.format
    cache_control: CacheControl | None = None  # the whole prompt, as if on its last block
    # annotations: they describe the request to the platform and change nothing in the answer
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: PositiveCount
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Probability | None = None
    top_k: Count | None = None
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    container: str | None = None
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    # servelm's (as on the OpenAI routes)
    seed: Seed | None = None
    timings_per_request: bool | None = None
    priority: Priority | None = None  # vLLM's: lower runs first (default 0)


# -- answers ------------------------------------------------------------------------------------------------
class TextOut(ResponseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseOut(ResponseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingOut(ResponseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class AnthropicUsage(ResponseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageResponse(ResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextOut | ToolUseOut | ThinkingOut]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal"] | None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class TokenCount(ResponseModel):
    input_tokens: int


class MessageEvent(NamedEvent):
    """One event of a streamed message: its type and the fields of that type."""
