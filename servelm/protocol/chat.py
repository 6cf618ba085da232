"""Chat Completions wire shapes (OpenAI's, with vLLM's and the seeds' extensions)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from servelm.protocol.common import (
    MAX_MESSAGES,
    MAX_PARTS,
    MAX_TOOLS,
    Count,
    GenerationFields,
    PositiveCount,
    ResponseModel,
    Usage,
    WireModel,
)


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


FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class FunctionCall(WireModel):
    name: str
    arguments: str


class ToolCallIn(WireModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(WireModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_PARTS)] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    function_call: FunctionCall | None = None  # deprecated: an assistant's call in the `functions` API
    refusal: None = None  # echoed back by clients that resend a response's message; must be empty
    # annotations a client resends with an earlier answer: nothing to do with them
    annotations: list[dict[str, Any]] | None = None
    audio: None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.function_call)):
            raise ValueError("content is required")
        if (self.tool_calls or self.function_call) and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls or function_call")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.role == "function" and not self.name:
            raise ValueError("a function message needs the name of the function it answers")
        return self


class JsonSchemaFormat(WireModel):
    name: FunctionName
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(WireModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_matches_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is json_schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema is only allowed when type is json_schema, not {self.type}")
        return self


class StructuredOutputs(WireModel):
    """vLLM's structured_outputs: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar or json_object")
        return self


class FunctionDef(WireModel):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(WireModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(WireModel):
    name: str


class NamedToolChoice(WireModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: PositiveCount | None = None
    # structured output and tools
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # deprecated, as OpenAI still serves them: tools of one call, answered as message.function_call
    functions: Annotated[list[FunctionDef], Field(min_length=1, max_length=128)] | None = None
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # text is the only output; audio is a 400 that says so
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # asks for the model's own default length
    # reasoning: the template's thinking switch (`none` turns it off) and a budget of reasoning tokens (servelm's:
    # past it the engine closes the thought itself); low, medium and high have the deployment's budgets
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    thinking_budget: Count | None = None


class FunctionCallOut(ResponseModel):
    name: str
    arguments: str


class ToolCallOut(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


def _absent(value: Any) -> bool:
    return value is None


class ChatMessageOut(ResponseModel):
    """As OpenAI answers: `refusal` always there (null), `tool_calls` and `function_call` only when there are
    calls (a null would fail clients that validate strictly: the spec types them as an array and an object)."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] | None = Field(None, exclude_if=_absent)
    function_call: FunctionCallOut | None = Field(None, exclude_if=_absent)  # the deprecated `functions` answer
    # a thinking model's thought, under both names in use (vLLM's reasoning_content, and reasoning)
    reasoning_content: str | None = Field(None, exclude_if=_absent)
    reasoning: str | None = Field(None, exclude_if=_absent)


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


class DeltaFunction(ResponseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(ResponseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction | None = None


class Delta(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    function_call: DeltaFunction | None = None  # the deprecated `functions` answer
    reasoning_content: str | None = None
    reasoning: str | None = None


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
