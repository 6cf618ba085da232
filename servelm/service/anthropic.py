"""POST /v1/messages, Anthropic's Messages API, over the chat service: the system prompt, messages, tools and
stop sequences become a chat request, and the chat answer becomes content blocks (text, tool_use, thinking), its
stream the Messages event sequence. /v1/messages/count_tokens counts the prompt the same request would read."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from servelm.errors import InvalidParameter
from servelm.protocol.anthropic import (
    AnthropicUsage,
    CountTokensRequest,
    CustomTool,
    MediaBlock,
    MessageEvent,
    MessageResponse,
    MessagesRequest,
    TextBlock,
    TextOut,
    ThinkingBlock,
    ThinkingOut,
    TokenCount,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
)
from servelm.protocol.chat import ChatCompletionRequest, ChatMessageOut, Delta
from servelm.protocol.common import Usage
from servelm.service.base import Translated
from servelm.service.chat import ChatService, PreparedChat
from servelm.service.params import RequestContext

PIN_SECONDS = {"5m": 300.0, "1h": 3600.0}
# a content filter's stop is Anthropic's `refusal` (its own classifiers' stop reason)
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}


@dataclass(frozen=True)
class PreparedMessage(Translated):
    chat: PreparedChat
    message_id: str
    stop_sequences: tuple[str, ...]

    @property
    def inner(self) -> PreparedChat:
        return self.chat


class MessagesService:
    operation = "chat"  # its GenAI operation name (traces)

    def __init__(self, chat: ChatService) -> None:
        self.chat = chat
        self.deployments = chat.deployments

    def prepare(self, req: MessagesRequest, ctx: RequestContext = RequestContext()) -> PreparedMessage:
        body = _chat_body(req)
        body.update(max_completion_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                    top_k=req.top_k, seed=req.seed, stop=req.stop_sequences, timings_per_request=req.timings_per_request,
                    priority=req.priority)
        if req.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        prepared = self.chat.prepare(_chat_request(body), ctx)
        pin = _pin_seconds(req)
        if pin:  # cache_control: the prompt's cells stay in the prefix cache, given up after the others
            prepared = dataclasses.replace(prepared, generation=dataclasses.replace(prepared.generation, pin_seconds=pin))
        return PreparedMessage(prepared, f"msg_{uuid.uuid4().hex}", tuple(req.stop_sequences or ()))

    def count_tokens(self, req: CountTokensRequest, ctx: RequestContext = RequestContext()) -> TokenCount:
        """The prompt's tokens, exactly as a request with these messages, system and tools reads them."""
        prepared = self.chat.prepare(_chat_request({**_chat_body(req), "max_completion_tokens": 1}), ctx)
        return TokenCount(input_tokens=len(prepared.generation.prompt_token_ids))

    async def complete(self, p: PreparedMessage) -> MessageResponse:
        completion = await self.chat.complete(p.chat)
        choice = completion.choices[0]
        extra = completion.model_extra or {}
        reason = _stop_reason(choice.finish_reason, choice.stop_reason, p.stop_sequences)
        return MessageResponse(
            **({"timings": extra["timings"]} if "timings" in extra else {}),
            id=p.message_id,
            model=completion.model,
            content=content_blocks(choice.message),
            stop_reason=reason,
            stop_sequence=choice.stop_reason if reason == "stop_sequence" else None,
            usage=_usage(completion.usage),
        )

    async def stream(self, p: PreparedMessage) -> AsyncGenerator[MessageEvent, None]:
        prompt = len(p.chat.generation.prompt_token_ids)
        start = MessageResponse(id=p.message_id, model=p.chat.model, content=[], stop_reason=None,
                                usage=AnthropicUsage(input_tokens=prompt, output_tokens=0))
        yield MessageEvent(type="message_start", message=start.model_dump(mode="json"))
        yield MessageEvent(type="ping")
        blocks = _BlockWriter()
        finish: str | None = None
        stop: str | int | None = None
        usage: Usage | None = None
        timings = None
        async for chunk in self.chat.chunks(p.chat):
            usage = chunk.usage or usage
            timings = (chunk.model_extra or {}).get("timings", timings)
            for choice in chunk.choices:
                for event in blocks.delta(choice.delta):
                    yield event
                if choice.finish_reason is not None:
                    finish, stop = choice.finish_reason, choice.stop_reason
        for event in blocks.close():
            yield event
        reason = _stop_reason(finish, stop, p.stop_sequences)
        delta = {"stop_reason": reason, "stop_sequence": stop if reason == "stop_sequence" else None}
        extra = {"timings": timings} if timings is not None else {}
        yield MessageEvent(type="message_delta", delta=delta,
                           usage=_usage(usage).model_dump() if usage else {"output_tokens": 0}, **extra)
        yield MessageEvent(type="message_stop")


def _chat_body(req: CountTokensRequest) -> dict[str, Any]:
    """The chat request's messages and tools (the part count_tokens shares)."""
    messages: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "\n".join(b.text for b in req.system)
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        messages += _messages(i, m.role, m.content)
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    tools = [t for t in req.tools or () if isinstance(t, CustomTool)]
    if req.tools and len(tools) < len(req.tools):
        raise InvalidParameter("Server tools (web search, code execution…) are not served here; send custom tools "
                               "with an input_schema.", "tools", "unsupported_parameter")
    choice = req.tool_choice
    if tools and (choice is None or choice.type != "none"):
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in tools]
        if choice is not None:
            if choice.type == "tool" and not choice.name:
                raise InvalidParameter("tool_choice of type 'tool' needs the tool's name.", "tool_choice.name")
            body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                                   else "required" if choice.type == "any" else "auto")
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
    elif choice is not None and choice.type in ("any", "tool"):
        raise InvalidParameter("tool_choice asks for a tool, but no tools were given.", "tool_choice")
    output = req.output_config
    if output is not None and output.effort is not None:
        body["reasoning_effort"] = "high" if output.effort in ("xhigh", "max") else output.effort
    if req.thinking is not None:
        if req.thinking.type == "disabled":
            body["reasoning_effort"] = "none"
        elif req.thinking.type == "enabled":
            if req.thinking.budget_tokens is None:
                raise InvalidParameter("thinking.budget_tokens is required when thinking is enabled.",
                                       "thinking.budget_tokens", "missing_required_parameter")
            body["thinking_budget"] = req.thinking.budget_tokens
    fmt = output.format if output is not None and output.format is not None else req.output_format
    if fmt is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
    return body


def _messages(i: int, role: str, content: Any) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool results become tool messages (first, as they answer
    the calls before them), an assistant's tool_use blocks its tool calls; thinking is left out."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    texts: list[str] = []
    images: list[tuple[int, str]] = []  # (texts before it, url)
    results: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where = f"messages.{i}.content.{j}"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            if role != "user":
                raise InvalidParameter("tool_result blocks belong in user messages.", where)
            text = block.content if isinstance(block.content, str) else "\n".join(b.text for b in block.content or ())
            results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": f"Error: {text}" if block.is_error else text})
        elif isinstance(block, ToolUseBlock):
            if role != "assistant":
                raise InvalidParameter("tool_use blocks belong in assistant messages.", where)
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input)}})
        elif isinstance(block, MediaBlock):
            images.append((len(texts), _image_url(block, where)))
        else:
            assert isinstance(block, ThinkingBlock)
    out = list(results)
    if calls:
        out.append({"role": "assistant", "content": "\n".join(texts) or None, "tool_calls": calls})
    elif images:
        parts: list[dict[str, Any]] = [{"type": "text", "text": t} for t in texts]
        for before, url in reversed(images):
            parts.insert(before, {"type": "image_url", "image_url": {"url": url}})
        out.append({"role": role, "content": parts})
    elif texts or not results:
        out.append({"role": role, "content": "\n".join(texts)})
    return out


def _image_url(block: MediaBlock, where: str) -> str:
    """An image block's source as a URL chat reads: base64 data as a data: URL, or its url."""
    source = getattr(block, "source", None)
    if block.type == "image" and isinstance(source, dict):
        if source.get("type") == "base64" and isinstance(source.get("data"), str):
            return f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
        if source.get("type") == "url" and isinstance(source.get("url"), str):
            return str(source["url"])
    raise InvalidParameter("This model reads text and images (base64 or url sources) only; send text or image "
                           "blocks.", where, "unsupported_content")


def _chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        raise InvalidParameter(f"Invalid request: {exc.errors()[0]['msg']}.", "messages") from None


def _pin_seconds(req: MessagesRequest) -> float:
    marks = [req.cache_control] + [b.cache_control for b in (req.system if isinstance(req.system, list) else ())]
    marks += [t.cache_control for t in req.tools or () if isinstance(t, CustomTool)]
    for m in req.messages:
        if not isinstance(m.content, str):
            marks += [getattr(b, "cache_control", None) for b in m.content]
    return max((PIN_SECONDS[c.ttl or "5m"] for c in marks if c is not None), default=0.0)


def _stop_reason(finish: str | None, stop: str | int | None, stop_sequences: tuple[str, ...]) -> str | None:
    if finish == "stop" and isinstance(stop, str) and stop in stop_sequences:
        return "stop_sequence"
    return _STOP_REASONS.get(finish or "", "end_turn") if finish is not None else None


def _usage(usage: Usage) -> AnthropicUsage:
    """Anthropic's count: input_tokens are the prompt tokens read, cache_read_input_tokens those the prefix cache
    held (count_tokens is their sum)."""
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return AnthropicUsage(input_tokens=usage.prompt_tokens - cached, output_tokens=usage.completion_tokens,
                          cache_read_input_tokens=cached)


def tool_use_id(call_id: str) -> str:
    return f"toolu_{call_id.removeprefix('call_')}"


def content_blocks(message: ChatMessageOut) -> list[TextOut | ToolUseOut | ThinkingOut]:
    blocks: list[TextOut | ToolUseOut | ThinkingOut] = []
    if message.reasoning_content:
        blocks.append(ThinkingOut(thinking=message.reasoning_content))
    if message.content:
        blocks.append(TextOut(text=message.content))
    for call in message.tool_calls or ():
        blocks.append(ToolUseOut(id=tool_use_id(call.id), name=call.function.name, input=_arguments(call.function.arguments)))
    return blocks


def _arguments(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return {"arguments": text}
    return value if isinstance(value, dict) else {"value": value}


class _BlockWriter:
    """Chat chunk deltas → content_block_start / content_block_delta / content_block_stop events."""

    def __init__(self) -> None:
        self.index = -1
        self._open: str | None = None  # the open block's type
        self._calls: set[int] = set()

    def delta(self, delta: Delta) -> list[MessageEvent]:
        events: list[MessageEvent] = []
        if delta.reasoning_content:
            if self._open != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning_content}))
        if delta.content:
            if self._open != "text":
                events += self._start({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls or ():
            if call.id is not None and call.index not in self._calls:
                self._calls.add(call.index)
                events += self._start({"type": "tool_use", "id": tool_use_id(call.id),
                                       "name": call.function.name if call.function else "", "input": {}})
            if call.function is not None and call.function.arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": call.function.arguments}))
        return events

    def _start(self, block: dict[str, Any]) -> list[MessageEvent]:
        events = self.close()
        self.index += 1
        self._open = block["type"]
        return events + [MessageEvent(type="content_block_start", index=self.index, content_block=block)]

    def _delta(self, delta: dict[str, Any]) -> MessageEvent:
        return MessageEvent(type="content_block_delta", index=self.index, delta=delta)

    def close(self) -> list[MessageEvent]:
        if self._open is None:
            return []
        self._open = None
        return [MessageEvent(type="content_block_stop", index=self.index)]
