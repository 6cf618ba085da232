"""OpenAI Responses API wire shapes (POST /v1/responses, its stream events, and the stored-response routes)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from servelm.protocol.chat import FunctionName
from servelm.protocol.common import (
    MAX_MESSAGES,
    MAX_PARTS,
    MAX_TOOLS,
    Count,
    NamedEvent,
    PositiveCount,
    ResponseModel,
    SamplingExtras,
    WireModel,
)

# bounds of an MCP tool's fields (service/mcp.py bounds what its server sends)
MAX_URL = 2048
MAX_DESCRIPTION = 4096
MAX_HEADERS = 32
MAX_HEADER_NAME = 256
MAX_HEADER_VALUE = 8192
MAX_ID = 256
MAX_REASON = 4096
McpLabel = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
McpName = Annotated[str, Field(min_length=1, max_length=128)]


# -- input items -------------------------------------------------------------------------------------------
class InputText(WireModel):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an earlier answer resent: nothing to do with them
    logprobs: list[Any] | None = None


class Refusal(WireModel):
    type: Literal["refusal"]
    refusal: str


class InputMedia(WireModel):
    """Image, file and audio input: recognised so that the answer can say this model takes text only."""

    model_config = WireModel.model_config | {"extra": "allow"}
    type: Literal["input_image", "input_file", "input_audio"]


ContentItem = Annotated[InputText | Refusal | InputMedia, Field(discriminator="type")]


class MessageItem(WireModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[list[ContentItem], Field(max_length=MAX_PARTS)]
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(WireModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(WireModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentItem]
    id: str | None = None
    status: str | None = None


class ReasoningText(WireModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItemIn(WireModel):
    """An earlier answer's reasoning, resent: it is not shown to the model again (as OpenAI drops it)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class McpApprovalResponseItem(WireModel):
    """The client's answer to an mcp_approval_request of the previous response: run that call, or do not."""

    type: Literal["mcp_approval_response"]
    approval_request_id: Annotated[str, Field(max_length=MAX_ID)]
    approve: bool
    reason: Annotated[str, Field(max_length=MAX_REASON)] | None = None
    id: str | None = None


class McpItemIn(WireModel):
    """An earlier response's MCP item, resent (mcp_list_tools, mcp_call, mcp_approval_request): a call with its output
    is shown to the model again as a tool call and its result; the others are not."""

    model_config = WireModel.model_config | {"extra": "allow"}
    type: Literal["mcp_list_tools", "mcp_call", "mcp_approval_request"]
    id: str | None = None
    server_label: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


def _item_tag(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("type", "message"))
    return str(getattr(value, "type", "message"))


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItemIn, Tag("reasoning")]
    | Annotated[McpApprovalResponseItem, Tag("mcp_approval_response")]
    | Annotated[McpItemIn, Tag("mcp_list_tools")] | Annotated[McpItemIn, Tag("mcp_call")]
    | Annotated[McpItemIn, Tag("mcp_approval_request")],
    Discriminator(_item_tag, custom_error_type="invalid_item",
                  custom_error_message="an input item is a message, function_call, function_call_output, reasoning, "
                                       "mcp_approval_response or an earlier response's MCP item"),
]


# -- tools and formats ---------------------------------------------------------------------------------------
class FunctionTool(WireModel):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class HostedTool(WireModel):
    """A tool OpenAI runs itself (web search, file search, code interpreter…): not served here; ignored with a
    warning in the response, since clients send them by default."""

    model_config = WireModel.model_config | {"extra": "allow"}
    type: str


class McpToolFilter(WireModel):
    tool_names: Annotated[list[McpName], Field(max_length=MAX_TOOLS)] | None = None
    read_only: bool | None = None


class McpApprovalFilter(WireModel):
    always: McpToolFilter | None = None
    never: McpToolFilter | None = None


class McpTool(WireModel):
    """A remote MCP server whose tools the model may call, run by this server (service/mcp.py)."""

    type: Literal["mcp"]
    server_label: McpLabel
    server_url: Annotated[str, Field(max_length=MAX_URL)] | None = None
    server_description: Annotated[str, Field(max_length=MAX_DESCRIPTION)] | None = None
    connector_id: str | None = None
    headers: Annotated[dict[Annotated[str, Field(max_length=MAX_HEADER_NAME)],
                            Annotated[str, Field(max_length=MAX_HEADER_VALUE)]],
                       Field(max_length=MAX_HEADERS)] | None = None
    authorization: Annotated[str, Field(max_length=MAX_HEADER_VALUE)] | None = None
    allowed_tools: Annotated[list[McpName], Field(max_length=MAX_TOOLS)] | McpToolFilter | None = None
    require_approval: Literal["always", "never"] | McpApprovalFilter | None = None

    def __repr__(self) -> str:  # its headers and authorization are the client's secrets: never in a log or trace
        return f"McpTool(server_label={self.server_label!r})"

    __str__ = __repr__


def _tool_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("function", "mcp") else "hosted"


ToolParam = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[McpTool, Tag("mcp")] | Annotated[HostedTool, Tag("hosted")],
    Discriminator(_tool_tag),
]


class FunctionChoice(WireModel):
    type: Literal["function"]
    name: str


class McpChoice(WireModel):
    type: Literal["mcp"]
    server_label: McpLabel
    name: McpName | None = None


class AllowedTools(WireModel):
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]


class TextFormat(WireModel):
    type: Literal["text", "json_object", "json_schema"]
    name: FunctionName | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextParam(WireModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningParam(WireModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ConversationRef(WireModel):
    id: Annotated[str, Field(max_length=MAX_ID)]


class ResponsesStreamOptions(WireModel):
    include_obfuscation: bool | None = None


class ResponsesRequest(SamplingExtras):
    input: str | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES)] = []
    instructions: str | None = None
    max_output_tokens: PositiveCount | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    text: TextParam | None = None
    tools: Annotated[list[ToolParam], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | McpChoice | AllowedTools | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: PositiveCount | None = None
    reasoning: ReasoningParam | None = None
    thinking_budget: Count | None = None  # servelm's, as on chat completions
    previous_response_id: str | None = None
    conversation: Annotated[str, Field(max_length=MAX_ID)] | ConversationRef | None = None
    store: bool | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    prompt_cache_retention: str | None = None


# -- output ----------------------------------------------------------------------------------------------------
class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(ResponseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = []


class FunctionCallOut(ResponseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningOutText(ResponseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOut(ResponseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = []
    content: list[ReasoningOutText] = []
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class McpListedTool(ResponseModel):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    annotations: dict[str, Any] | None = None


class McpListToolsOut(ResponseModel):
    type: Literal["mcp_list_tools"] = "mcp_list_tools"
    id: str
    server_label: str
    tools: list[McpListedTool] = []
    error: str | None = None


class McpCallOut(ResponseModel):
    type: Literal["mcp_call"] = "mcp_call"
    id: str
    server_label: str
    name: str
    arguments: str = ""
    output: str | None = None
    error: dict[str, Any] | None = None  # an MCPToolExecutionError, MCPProtocolError or HTTPError
    status: Literal["in_progress", "completed", "incomplete", "calling", "failed"] = "completed"
    approval_request_id: str | None = None


class McpApprovalRequestOut(ResponseModel):
    type: Literal["mcp_approval_request"] = "mcp_approval_request"
    id: str
    server_label: str
    name: str
    arguments: str = ""


OutputItem = OutputMessage | FunctionCallOut | ReasoningOut | McpListToolsOut | McpCallOut | McpApprovalRequestOut


class InputTokensDetails(ResponseModel):
    cached_tokens: int = 0


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(ResponseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    conversation: dict[str, str] | None = None
    reasoning: dict[str, Any] = {"effort": None, "summary": None}
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = {"format": {"type": "text"}}
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = []
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = {}
    warnings: list[str] | None = Field(None, exclude_if=lambda v: not v)  # tools ignored (not served here)


class DeletedResponse(ResponseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class InputItemList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ResponseEvent(NamedEvent):
    """One event of a streamed response: its type, its place in the stream, and the fields of that type."""

    sequence_number: int
