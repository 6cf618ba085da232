"""POST /v1/responses, the OpenAI Responses API, over the chat service: the request's items become a chat request
(its messages, tools, format and sampling), the chat answer becomes output items, and its stream becomes the
Responses event sequence. `store` keeps the answer (service/store.py) for GET, DELETE and previous_response_id."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from servelm.errors import ClientError, InvalidParameter, NotFound
from servelm.protocol.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChatMessageOut, Delta
from servelm.protocol.common import MAX_MESSAGES, SamplingExtras, Usage
from servelm.protocol.responses import (
    AllowedTools,
    ConversationRef,
    FunctionCallItem,
    FunctionCallOut,
    FunctionCallOutputItem,
    FunctionChoice,
    FunctionTool,
    IncompleteDetails,
    InputItemList,
    InputMedia,
    InputTokensDetails,
    McpApprovalRequestOut,
    McpApprovalResponseItem,
    McpCallOut,
    McpChoice,
    McpItemIn,
    McpListedTool,
    McpListToolsOut,
    McpTool,
    MessageItem,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItemIn,
    ReasoningOut,
    ReasoningOutText,
    Refusal,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from servelm.service import hosted_mcp
from servelm.service.base import Translated
from servelm.service.chat import ChatService, PreparedChat
from servelm.service.conversations import ITEM_PREFIX, ConversationsService, MemoryConversations, page_of, stored_item
from servelm.service.hosted_mcp import Exposed, McpPlan, McpServer, McpSettings
from servelm.service.mcp import McpBudget, McpResult, McpSession, McpUnavailable, StdioSession, check_server_url
from servelm.service.mcp import McpTool as McpToolListed
from servelm.service.params import RequestContext
from servelm.service.store import ResponseStore, StoredResponse

LOGPROBS_INCLUDE = "message.output_text.logprobs"
SECRETS = {"headers", "authorization"}  # an mcp tool's fields never echoed back, stored or traced
# chat finish reasons that leave a response incomplete, and the reason it gives
_INCOMPLETE: dict[str | None, Literal["max_output_tokens", "content_filter"]] = {
    "length": "max_output_tokens", "content_filter": "content_filter"}


@dataclass(frozen=True)
class PreparedResponse(Translated):
    chat: PreparedChat
    request: ResponsesRequest
    owner: str
    response_id: str
    created_at: int
    input_items: list[dict[str, Any]]
    history: list[dict[str, Any]]  # the conversation before this input (from previous_response_id)
    warnings: list[str]
    conversation: str | None = None  # the conversation it continues and adds its items to
    chat_body: dict[str, Any] = field(default_factory=dict)  # the chat request, without MCP tools (a turn's base)
    mcp: McpPlan | None = None  # the MCP servers it names, and the approvals it answers
    ctx: RequestContext = RequestContext()

    @property
    def inner(self) -> PreparedChat:
        return self.chat


class ResponsesService:
    operation = "chat"  # its GenAI operation name (traces)

    def __init__(self, chat: ChatService, store: ResponseStore, mcp: McpSettings = McpSettings(),
                 conversations: ConversationsService | None = None) -> None:
        self.chat = chat
        self.deployments = chat.deployments
        self.store = store
        self.mcp = mcp
        self.configured = hosted_mcp.Configured(mcp.configured)  # the operator's MCP servers (started with the app)
        self.conversations = conversations or ConversationsService(MemoryConversations())

    # -- validation and conversion ----------------------------------------------------------------
    def prepare(self, req: ResponsesRequest, ctx: RequestContext = RequestContext()) -> PreparedResponse:
        _reject_unsupported(req)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = self.store.get(ctx.owner, req.previous_response_id)
            if previous is None:
                raise NotFound(f"Previous response with id '{req.previous_response_id}' not found.",
                               param="previous_response_id", code="previous_response_not_found")
            history = previous.history
        conversation = req.conversation.id if isinstance(req.conversation, ConversationRef) else req.conversation
        if conversation is not None:
            if req.previous_response_id is not None:
                raise InvalidParameter("Give a conversation or a previous_response_id, not both.", "conversation")
            try:
                history = self.conversations.history(ctx.owner, conversation)
            except NotFound:
                raise NotFound(f"Conversation with id '{conversation}' not found.", param="conversation",
                               code="not_found") from None
        items = input_items(req)
        source = "conversation" if conversation is not None else "previous_response_id"
        if len(history) + len(items) > MAX_MESSAGES:  # the chat request's own bound, named for what the client sent
            raise InvalidParameter(f"The {source} holds {len(history)} items, and with the input's {len(items)} they "
                                   f"are more than the {MAX_MESSAGES} a response reads.", source)
        if conversation is not None:  # refused before anything runs, not after the answer is made
            self.conversations.check_room(len(history) + len(items) + 1)
        tools, warnings = _tools(req)
        mcp = hosted_mcp.plan(req, history, self.store, ctx.owner, self.mcp) if _names_mcp(req) else None
        body: dict[str, Any] = req.model_dump(include=set(SamplingExtras.model_fields), exclude_none=True)
        origins: list[str] = []  # each message's item, for the names in chat's errors
        body["messages"] = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + \
            chat_messages(history + items, len(history), source, origins)
        body["max_completion_tokens"] = req.max_output_tokens
        if tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in tools]
            body["tool_choice"] = "auto" if isinstance(req.tool_choice, McpChoice) else _tool_choice(req.tool_choice)
            body["parallel_tool_calls"] = req.parallel_tool_calls is not False and req.max_tool_calls != 1
        elif isinstance(req.tool_choice, FunctionChoice) or req.tool_choice == "required" and mcp is None:
            raise InvalidParameter("tool_choice asks for a function call, but no function tools were given.",
                                   "tool_choice")
        body["response_format"] = _response_format(req)
        if req.top_logprobs is not None or LOGPROBS_INCLUDE in (req.include or ()):
            body["logprobs"], body["top_logprobs"] = True, req.top_logprobs or 0
        body["thinking_budget"] = req.thinking_budget
        if req.reasoning is not None and req.reasoning.effort is not None:
            body["reasoning_effort"] = "high" if req.reasoning.effort == "xhigh" else req.reasoning.effort
        if req.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        try:
            chat_req = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as exc:
            err = exc.errors()[0]
            raise InvalidParameter(f"Invalid input: {err['msg']}.", "input") from None
        try:
            prepared = self.chat.prepare(chat_req, ctx)
        except ClientError as exc:
            raise _named_by_item(exc, origins, 1 if req.instructions else 0) from None
        return PreparedResponse(prepared, req, ctx.owner, f"resp_{uuid.uuid4().hex}", int(time.time()), items,
                                history, warnings, conversation, body, mcp, ctx)

    # -- running ----------------------------------------------------------------------------------
    async def complete(self, p: PreparedResponse) -> ResponseObject:
        if p.mcp is not None:  # its turns and calls as the stream makes them, the last event's response
            last = None
            async for event in self.stream(p):
                last = event
            assert last is not None and last.model_extra is not None
            return ResponseObject.model_validate(last.model_extra["response"])
        completion = await self.chat.complete(p.chat)
        choice = completion.choices[0]
        response = self._response(p, output_items(choice.message, choice.logprobs), choice.finish_reason, completion)
        await self._keep(p, response)
        return response

    async def stream(self, p: PreparedResponse) -> AsyncGenerator[ResponseEvent, None]:
        events = _EventWriter()
        shell = self._response(p, [], None, None)
        yield events.make("response.created", response=shell)
        yield events.make("response.in_progress", response=shell)
        turn = _Turn()
        if p.mcp is None:
            async for event in turn.run(self.chat.chunks(p.chat), events):
                yield event
        else:
            async for event in self._agent(p, events, turn):
                yield event
        finish, last = turn.finish, turn.last
        if not any(isinstance(i, (OutputMessage, FunctionCallOut, McpApprovalRequestOut)) for i in events.items):
            for event in events.delta(Delta(content=""), None, force=True):  # an empty answer is an empty message
                yield event
        for event in events.close():
            yield event
        if last is not None and turn.usage is not None:
            last = last.model_copy(update={"usage": turn.usage})  # every turn's tokens
        response = self._response(p, events.items, finish, last)
        await self._keep(p, response)
        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        yield events.make(kind, response=response)

    async def _agent(self, p: PreparedResponse, events: _EventWriter, turn: _Turn) -> AsyncGenerator[ResponseEvent, None]:
        """A response with MCP tools: each server's tools listed, the approved calls run, then chat turns until
        one answers without calling an MCP tool (or calls one that needs approval, or a function of the client's),
        each call run between them; at most max_calls calls, the last turn told to answer."""
        assert p.mcp is not None
        plan, limits = p.mcp, p.mcp.settings.limits
        budget = McpBudget(limits.total_s)  # the MCP steps' time, not the generation's between them
        max_calls = min(limits.max_calls, p.request.max_tool_calls or limits.max_calls)
        async with AsyncExitStack() as stack:
            sessions: dict[str, McpSession | StdioSession] = {}
            listed: list[tuple[McpServer, list[McpToolListed]]] = []
            for server in plan.servers:
                async for event in self._list(server, plan, events, stack, budget, sessions, listed):
                    yield event
            functions = list(p.chat_body.get("tools", ()))
            exposed = hosted_mcp.expose(listed, {t["function"]["name"] for t in functions})
            by_function = {e.function: e for e in exposed}
            messages = list(p.chat_body["messages"])
            async for event in _answer_approvals(plan, exposed, sessions, events, messages):
                yield event
            calls = sum(a.approve for a in plan.approvals)
            before = [g.request_id for g in p.chat.generations]
            choice = self._first_choice(p, exposed) if not plan.approvals else "auto"
            while True:
                body = {**p.chat_body, "messages": messages, "stream": True, "stream_options": {"include_usage": True},
                        "tools": [*functions, *(e.chat_tool() for e in exposed)],
                        "tool_choice": "none" if calls >= max_calls else choice}
                prepared = await self._prepare_turn(p, body, before, [e.server.label for e in exposed])
                before = [g.request_id for g in prepared.generations]
                events.pending.clear()
                text_from = len(events.items)
                async for event in turn.run(self.chat.chunks(prepared), events, by_function):
                    yield event
                for event in events.close() + events.offer(turn.finish):
                    yield event
                pending = list(events.pending)
                runs = [(item, cid, ex) for item, cid, ex in pending if isinstance(item, McpCallOut)]
                if not runs:
                    break
                text = "".join(c.text for i in events.items[text_from:] if isinstance(i, OutputMessage) for c in i.content)
                messages.append(_assistant_calls(text or None, [(cid, ex.function, item.arguments)
                                                                for item, cid, ex in runs]))
                for item, cid, _ in runs:
                    async for event in _run_call(events, item, sessions[item.server_label]):
                        yield event
                    calls += 1
                    messages.append({"role": "tool", "tool_call_id": cid, "content": _call_result(item)})
                if len(runs) < len(pending) or any(isinstance(i, FunctionCallOut) for i in events.items[text_from:]):
                    break  # an approval asked, or a function of the client's called: the client goes on
                choice = "auto"

    async def _list(self, server: McpServer, plan: McpPlan, events: _EventWriter, stack: AsyncExitStack,
                    budget: McpBudget, sessions: dict[str, McpSession | StdioSession],
                    listed: list[tuple[McpServer, list[McpToolListed]]]) -> AsyncGenerator[ResponseEvent, None]:
        """One server connected (its session kept in `stack` and `sessions`) and its tools listed (into `listed`),
        with the mcp_list_tools item's events; McpUnavailable, after its failed event, when it cannot be."""
        limits = plan.settings.limits
        listing = McpListToolsOut(id=f"mcpl_{uuid.uuid4().hex}", server_label=server.label)
        for event in events.begin(listing):
            yield event
        index = events.items.index(listing)
        yield events.make("response.mcp_list_tools.in_progress", item_id=listing.id, output_index=index)
        try:
            if server.configured:
                session = self.configured.open(server.label, limits, budget)
            else:
                await check_server_url(server.url, plan.settings.allowed, f"{server.where}.server_url")
                session = McpSession(server.label, server.url, server.headers, limits, budget)
            sessions[server.label] = await stack.enter_async_context(session)
            tools = await session.list_tools(server.allowed_tools)
        except McpUnavailable as exc:
            listing.error = exc.message
            yield events.make("response.mcp_list_tools.failed", item_id=listing.id, output_index=index)
            for event in events.close():
                yield event
            raise
        listing.tools = [McpListedTool(name=t.name, input_schema=t.input_schema, description=t.description or None,
                                       annotations={"read_only": True} if t.read_only else None) for t in tools]
        yield events.make("response.mcp_list_tools.completed", item_id=listing.id, output_index=index)
        for event in events.close():
            yield event
        listed.append((server, tools))

    def _first_choice(self, p: PreparedResponse, exposed: list[Exposed]) -> Any:
        choice = p.request.tool_choice
        if isinstance(choice, McpChoice):
            named = [e for e in exposed if e.server.label == choice.server_label
                     and (choice.name is None or e.tool.name == choice.name)]
            if not named:
                raise InvalidParameter(f"tool_choice names {choice.name!r} of the MCP server {choice.server_label!r}, "
                                       "which it does not list.", "tool_choice")
            if choice.name is not None:
                return {"type": "function", "function": {"name": named[0].function}}
            return "required"
        return p.chat_body.get("tool_choice", "required" if choice == "required" else "auto")

    async def _prepare_turn(self, p: PreparedResponse, body: dict[str, Any], before: list[str],
                            labels: list[str]) -> PreparedChat:
        """A turn's chat request prepared as any (off the event loop; a tool's output is the prompt's like any
        text: its limits and the content policy's check), in the admission of the response's earlier turns."""
        try:
            chat_req = ChatCompletionRequest.model_validate(body)
            prepared = await asyncio.to_thread(self.chat.prepare, chat_req, p.ctx)
        except (ValidationError, InvalidParameter) as exc:
            # the client's own fields were checked before: what fails now is a tool an MCP server listed
            label = _blamed_server(exc, labels, len(p.chat_body.get("tools", ())))
            if label is None:
                raise
            raise McpUnavailable(label, "with a tool the model cannot use (its name or schema) from") from None
        prepared.deployment.queue.follow(before, [g.request_id for g in prepared.generations])
        if prepared.screening is not None:
            await prepared.screening.check_prompt()
        return prepared

    def _response(self, p: PreparedResponse, output: list[OutputItem], finish: str | None,
                  answer: ChatCompletion | ChatCompletionChunk | None) -> ResponseObject:
        req = p.request
        usage = answer.usage if answer is not None else None
        extra = {}
        if answer is not None and answer.model_extra and "timings" in answer.model_extra:
            extra["timings"] = answer.model_extra["timings"]
        reasoning_tokens = 0
        if usage is not None and usage.model_extra and usage.model_extra.get("completion_tokens_details"):
            reasoning_tokens = usage.model_extra["completion_tokens_details"].get("reasoning_tokens", 0)
        return ResponseObject(
            **extra,
            id=p.response_id,
            created_at=p.created_at,
            completed_at=int(time.time()) if finish is not None else None,
            status="in_progress" if finish is None else "incomplete" if finish in _INCOMPLETE else "completed",
            incomplete_details=IncompleteDetails(reason=_INCOMPLETE[finish]) if finish in _INCOMPLETE else None,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            model=p.chat.model,
            output=output,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            previous_response_id=req.previous_response_id,
            conversation={"id": p.conversation} if p.conversation is not None else None,
            reasoning={"effort": req.reasoning.effort if req.reasoning else None,
                       "summary": req.reasoning.summary if req.reasoning else None},
            store=req.store is not False,
            temperature=1.0 if req.temperature is None else req.temperature,
            text={"format": req.text.format.model_dump(by_alias=True, exclude_none=True)}
            if req.text and req.text.format else {"format": {"type": "text"}},
            tool_choice=req.tool_choice.model_dump() if isinstance(req.tool_choice, BaseModel) else req.tool_choice or "auto",
            tools=[t.model_dump(by_alias=True, exclude_none=True, exclude=SECRETS if isinstance(t, McpTool) else None)
                   for t in req.tools or ()],
            top_p=1.0 if req.top_p is None else req.top_p,
            truncation=req.truncation or "disabled",
            usage=None if usage is None else ResponseUsage(
                input_tokens=usage.prompt_tokens,
                input_tokens_details=InputTokensDetails(
                    cached_tokens=usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0),
                output_tokens=usage.completion_tokens,
                output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
                total_tokens=usage.total_tokens,
            ),
            user=req.user,
            metadata=req.metadata or {},
            warnings=p.warnings,
        )

    async def _keep(self, p: PreparedResponse, response: ResponseObject) -> None:
        body = response.model_dump(mode="json")
        if p.conversation is not None:  # its input and output join the conversation, whatever `store` says
            added = [stored_item(item) for item in p.input_items + body["output"]]
            if not await asyncio.to_thread(self.conversations.store.add, p.owner, p.conversation, added):
                raise NotFound(f"Conversation with id '{p.conversation}' not found.", param="conversation",
                               code="not_found")
        if p.request.store is False:
            return
        output = [_as_input(item) for item in body["output"]]
        entry = StoredResponse(body, p.input_items, p.history + p.input_items + output)
        await asyncio.to_thread(self.store.put, p.owner, p.response_id, entry)

    # -- the stored responses -----------------------------------------------------------------------
    def stored(self, owner: str, response_id: str) -> StoredResponse:
        found = self.store.get(owner, response_id)
        if found is None:
            raise NotFound(f"Response with id '{response_id}' not found.", param="response_id", code="not_found")
        return found

    def delete(self, owner: str, response_id: str) -> None:
        if not self.store.delete(owner, response_id):
            raise NotFound(f"Response with id '{response_id}' not found.", param="response_id", code="not_found")

    def input_item_list(self, owner: str, response_id: str, order: str = "desc", limit: int = 20,
                        after: str | None = None) -> InputItemList:
        page, more = page_of(self.stored(owner, response_id).input_items, order, limit, after)
        return InputItemList(data=page, first_id=page[0]["id"] if page else None,
                             last_id=page[-1]["id"] if page else None, has_more=more)


async def _answer_approvals(plan: McpPlan, exposed: list[Exposed], sessions: dict[str, McpSession | StdioSession],
                            events: _EventWriter, messages: list[dict[str, Any]]) -> AsyncGenerator[ResponseEvent, None]:
    """The approvals the request answered: each approved call run (an mcp_call item with its events), each one
    refused told to the model, both added to `messages` as the call and its result."""
    for approval in plan.approvals:
        found = next((e for e in exposed if e.server.label == approval.server_label and e.tool.name == approval.name),
                     None)
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        messages.append(_assistant_calls(None, [(call_id, found.function if found else approval.name,
                                                approval.arguments)]))
        if not approval.approve:
            reason = f": {approval.reason}" if approval.reason else "."
            messages.append({"role": "tool", "tool_call_id": call_id, "content": f"The call was not approved{reason}"})
            continue
        call = McpCallOut(id=f"mcp_{uuid.uuid4().hex}", server_label=approval.server_label, name=approval.name,
                          arguments=approval.arguments, status="in_progress", approval_request_id=approval.request_id)
        for event in events.begin(call) + events.close():
            yield event
        async for event in _run_call(events, call, sessions[approval.server_label] if found else None):
            yield event
        messages.append({"role": "tool", "tool_call_id": call_id, "content": _call_result(call)})


def _json_object(text: str) -> dict[str, Any] | None:
    """The call arguments' object (None when they are not one: cut short, or not JSON)."""
    try:
        found = json.loads(text)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


async def _run_call(events: _EventWriter, call: McpCallOut,
                    session: McpSession | StdioSession | None) -> AsyncGenerator[ResponseEvent, None]:
    """One MCP call run, with its events: in progress, then completed or failed, and its item done. No session:
    the request no longer allows the tool (an approved call whose tool its allowed_tools leave out)."""
    index = events.items.index(call)
    yield events.make("response.mcp_call.in_progress", item_id=call.id, output_index=index)
    arguments = _json_object(call.arguments or "{}")
    if session is None:
        result = McpResult(None, f"The tool {call.name!r} is not among the tools this request allows.")
    elif arguments is None:
        result = McpResult(None, "The call's arguments are not a JSON object.")
    else:
        result = await session.call(call.name, arguments)
    call.output = result.output
    if result.error is not None:
        call.error = {"type": "http_error", "code": McpUnavailable.status, "message": result.error} \
            if result.server_failed else {"type": "mcp_tool_execution_error",
                                          "content": [{"type": "text", "text": result.error}]}
    call.status = "completed" if result.error is None else "failed"
    yield events.make("response.mcp_call.completed" if result.error is None else "response.mcp_call.failed",
                      item_id=call.id, output_index=index)
    yield events.make("response.output_item.done", output_index=index, item=call)


def _blamed_server(exc: Exception, labels: list[str], functions: int) -> str | None:
    """The MCP server whose listed tool a turn's chat request failed on (`labels`: the server of each listed tool,
    after the client's `functions`), or None when the failure is not a listed tool's."""
    param = exc.param if isinstance(exc, InvalidParameter) else \
        ".".join(str(x) for x in exc.errors()[0]["loc"]) if isinstance(exc, ValidationError) else None
    found = re.match(r"tools[\[.](\d+)", param or "")
    index = int(found.group(1)) - functions if found is not None else -1
    return labels[index] if 0 <= index < len(labels) else None


def _call_result(call: McpCallOut) -> str:
    """What the model reads of a call: its output, or its error."""
    if call.error is None:
        return call.output or ""
    message = call.error.get("message") or " ".join(str(c.get("text", "")) for c in call.error.get("content", ()))
    return f"Error: {message}"


def _assistant_calls(text: str | None, calls: list[tuple[str, str, str]]) -> dict[str, Any]:
    return {"role": "assistant", "content": text, "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}
        for cid, name, arguments in calls]}


class _Turn:
    """A response's chat turns as they stream through the event writer: the last turn's finish and chunk, and the
    usage of them all."""

    def __init__(self) -> None:
        self.finish: str | None = None
        self.last: ChatCompletionChunk | None = None
        self.usage: Usage | None = None

    async def run(self, chunks: AsyncGenerator[ChatCompletionChunk, None], events: _EventWriter,
                  mcp: dict[str, Exposed] | None = None) -> AsyncGenerator[ResponseEvent, None]:
        self.finish = None
        async for chunk in chunks:
            self.last = chunk
            if chunk.usage is not None:
                self.usage = chunk.usage if self.usage is None else _sum_usage(self.usage, chunk.usage)
            for choice in chunk.choices:
                for event in events.delta(choice.delta, choice.logprobs, mcp=mcp):
                    yield event
                self.finish = choice.finish_reason or self.finish


def _sum_usage(a: Usage, b: Usage) -> Usage:
    def reasoning(u: Usage) -> int:
        details = (u.model_extra or {}).get("completion_tokens_details") or {}
        return int(details.get("reasoning_tokens", 0))

    cached = sum(u.prompt_tokens_details.cached_tokens for u in (a, b) if u.prompt_tokens_details is not None)
    out = b.model_copy(update={"prompt_tokens": a.prompt_tokens + b.prompt_tokens,
                               "completion_tokens": a.completion_tokens + b.completion_tokens,
                               "total_tokens": a.total_tokens + b.total_tokens})
    if b.prompt_tokens_details is not None:
        out.prompt_tokens_details = b.prompt_tokens_details.model_copy(update={"cached_tokens": cached})
    if out.model_extra is not None and "completion_tokens_details" in out.model_extra:
        out.model_extra["completion_tokens_details"] = {
            **out.model_extra["completion_tokens_details"], "reasoning_tokens": reasoning(a) + reasoning(b)}
    return out


# -- request → chat ----------------------------------------------------------------------------------------------
def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items (JSON), each with an id (a string input is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": req.input}],
                 "id": f"msg_{uuid.uuid4().hex}"}]
    out = []
    for item in req.input:
        data = item.model_dump(by_alias=True, exclude_none=True)
        data.setdefault("id", f"{ITEM_PREFIX[data['type']]}_{uuid.uuid4().hex}")
        if data["type"] == "message" and isinstance(data["content"], str):  # as OpenAI lists it: a text part
            kind = "output_text" if data["role"] == "assistant" else "input_text"
            data["content"] = [{"type": kind, "text": data["content"]}]
        out.append(data)
    return out


def _named_by_item(exc: ClientError, origins: list[str], offset: int) -> ClientError:
    """A chat error about messages[N] named by the item N came from: input[K] (and the part of it), or the
    conversation or previous_response_id whose item it is."""
    found = re.match(r"messages\.?\[(\d+)\](.*)", exc.param or "")
    if found is not None and 0 <= int(found[1]) - offset < len(origins):
        where = origins[int(found[1]) - offset]
        exc.param = where + found[2] if where.startswith("input") else where
    return exc


def chat_messages(items: list[dict[str, Any]], first: int = 0, source: str = "previous_response_id",
                  origins: list[str] | None = None) -> list[dict[str, Any]]:
    """Items (JSON) as chat messages: function calls join the assistant message before them, outputs become tool
    messages, reasoning is left out. `first`: how many items came from `source` (previous_response_id or
    conversation; errors name input positions after them). `origins`, if given, gets each message's item's name."""
    messages: list[dict[str, Any]] = []
    where = source
    for n, data in enumerate(items):
        if origins is not None:
            origins.extend([where] * (len(messages) - len(origins)))  # the messages the item before it made
        kind = data.get("type", "message")
        where = f"input[{n - first}]" if n >= first else source
        if kind == "message":
            item = MessageItem.model_validate(data)
            messages.append({"role": item.role, "content": _text(item.content, where)})
        elif kind == "function_call":
            call = FunctionCallItem.model_validate(data)
            tool_call = {"id": call.call_id, "type": "function",
                         "function": {"name": call.name, "arguments": call.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(tool_call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [tool_call]})
        elif kind == "function_call_output":
            result = FunctionCallOutputItem.model_validate(data)
            output = result.output if isinstance(result.output, str) else _text(result.output, where)
            if not isinstance(output, str):
                raise InvalidParameter("A function call's output is text; send images in a message.", where)
            messages.append({"role": "tool", "tool_call_id": result.call_id, "content": output})
        elif kind == "mcp_call":  # an earlier call: shown again as the call and its result
            ran = McpItemIn.model_validate(data)
            call_id = f"call_{ran.id or uuid.uuid4().hex}"[:64]
            messages.append(_assistant_calls(None, [(call_id, ran.name or "", ran.arguments or "{}")]))
            messages.append({"role": "tool", "tool_call_id": call_id, "content": ran.output or ""})
        elif kind in ("mcp_list_tools", "mcp_approval_request"):
            McpItemIn.model_validate(data)
        elif kind == "mcp_approval_response":
            McpApprovalResponseItem.model_validate(data)  # run by the response (service/hosted_mcp.py)
        else:
            ReasoningItemIn.model_validate(data)
    if origins is not None:
        origins.extend([where] * (len(messages) - len(origins)))
    return messages


def _text(content: str | list[Any], where: str) -> str | list[dict[str, Any]]:
    """A message's content as chat's: its text, or text and image_url parts when it holds input_image parts."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if isinstance(part, InputMedia):
            url = getattr(part, "image_url", None)
            if part.type != "input_image" or not isinstance(url, str):
                raise InvalidParameter("This model reads text and images given by image_url only; send input_text "
                                       "parts, or input_image with an image_url.", f"{where}.content[{j}]",
                                       "unsupported_content")
            parts.append({"type": "image_url", "image_url": {"url": url, "detail": getattr(part, "detail", None)}})
        else:
            parts.append({"type": "text", "text": part.refusal if isinstance(part, Refusal) else part.text})
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def _tools(req: ResponsesRequest) -> tuple[list[FunctionTool], list[str]]:
    functions = [t for t in req.tools or () if isinstance(t, FunctionTool)]
    ignored = sorted({t.type for t in req.tools or () if not isinstance(t, (FunctionTool, McpTool))})
    warnings = [f"The {kind} tool is not served here; it was ignored." for kind in ignored]
    if isinstance(req.tool_choice, AllowedTools):
        allowed = {t.get("name") for t in req.tool_choice.tools if t.get("type") == "function"}
        functions = [t for t in functions if t.name in allowed]
    return functions, warnings


def _names_mcp(req: ResponsesRequest) -> bool:
    return any(isinstance(t, McpTool) for t in req.tools or ()) or isinstance(req.tool_choice, McpChoice) or \
        any(isinstance(i, McpApprovalResponseItem) for i in (req.input if isinstance(req.input, list) else ()))


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    if isinstance(choice, AllowedTools):
        return choice.mode
    return choice


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.name is None:
        raise InvalidParameter("Missing required parameter: 'text.format.name'.", "text.format.name",
                               "missing_required_parameter")
    if fmt.schema_ is None:
        raise InvalidParameter("Missing required parameter: 'text.format.schema'.", "text.format.schema",
                               "missing_required_parameter")
    schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def _reject_unsupported(req: ResponsesRequest) -> None:
    if req.background:
        raise InvalidParameter("Background responses are not supported; leave out background.", "background",
                               "unsupported_parameter")
    if req.truncation == "auto":
        raise InvalidParameter("truncation 'auto' is not supported: an input longer than the context window is a "
                               "400; leave out truncation or send 'disabled'.", "truncation", "unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise InvalidParameter("stream_options is only allowed when stream is true.", "stream_options")
    if isinstance(req.input, list) and not req.input and req.previous_response_id is None:
        raise InvalidParameter("Missing required parameter: 'input'.", "input", "missing_required_parameter")


# -- chat → output items ---------------------------------------------------------------------------------------
def output_items(message: ChatMessageOut, logprobs: Any = None) -> list[OutputItem]:
    items: list[OutputItem] = []
    if message.reasoning_content:
        items.append(ReasoningOut(id=f"rs_{uuid.uuid4().hex}",
                                  content=[ReasoningOutText(text=message.reasoning_content)]))
    if message.content or not message.tool_calls:
        entries = logprobs.get("content") if isinstance(logprobs, dict) else None
        items.append(OutputMessage(id=f"msg_{uuid.uuid4().hex}",
                                   content=[OutputText(text=message.content or "", logprobs=entries or [])]))
    for call in message.tool_calls or ():
        items.append(FunctionCallOut(id=f"fc_{uuid.uuid4().hex}", call_id=call.id, name=call.function.name,
                                     arguments=call.function.arguments))
    return items


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    """An output item (JSON) as the input item that resends it."""
    if item["type"] == "message":
        return {"type": "message", "role": "assistant", "id": item["id"],
                "content": [{"type": "output_text", "text": c["text"]} for c in item["content"]]}
    if item["type"] == "function_call":
        return {k: item[k] for k in ("type", "id", "call_id", "name", "arguments")}
    if item["type"] in _MCP_KEPT:
        return {k: item.get(k) for k in _MCP_KEPT[item["type"]]}
    return {"type": "reasoning", "id": item["id"], "summary": []}


# what the conversation keeps of each MCP output item (the calls' results, the approvals asked)
_MCP_KEPT = {"mcp_list_tools": ("type", "id", "server_label"),
             "mcp_call": ("type", "id", "server_label", "name", "arguments", "output"),
             "mcp_approval_request": ("type", "id", "server_label", "name", "arguments")}


class _EventWriter:
    """Chat chunk deltas → Responses events: each output item opens (output_item.added, and a message's
    content_part.added), grows by deltas, and closes (the .done events) when the next begins or the answer ends."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None
        self._calls: dict[int, FunctionCallOut | McpCallOut | McpApprovalRequestOut] = {}
        # the MCP calls begun (each with its chat call id and its tool), run by the response between turns
        self.pending: list[tuple[McpCallOut | McpApprovalRequestOut, str, Exposed]] = []

    def make(self, kind: str, **fields: Any) -> ResponseEvent:
        # nested objects as they are now (an item grows after its added event)
        fields = {k: v.model_dump(mode="json", by_alias=True) if isinstance(v, BaseModel) else v for k, v in fields.items()}
        event = ResponseEvent(type=kind, sequence_number=self.sequence, **fields)
        self.sequence += 1
        return event

    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def delta(self, delta: Delta, logprobs: Any, force: bool = False,
              mcp: dict[str, Exposed] | None = None) -> list[ResponseEvent]:
        events: list[ResponseEvent] = []
        if delta.reasoning_content:
            if not isinstance(self._open, ReasoningOut):
                events += self.begin(ReasoningOut(id=f"rs_{uuid.uuid4().hex}", status="in_progress",
                                                   content=[ReasoningOutText(text="")]))
            assert isinstance(self._open, ReasoningOut)
            thought = delta.reasoning_content
            self._open.content[0].text += thought
            events.append(self.make("response.reasoning_text.delta", item_id=self._open.id, output_index=self._index,
                                    content_index=0, delta=thought))
        if delta.content or force:
            if not isinstance(self._open, OutputMessage):
                events += self.begin(OutputMessage(id=f"msg_{uuid.uuid4().hex}", status="in_progress"))
                assert isinstance(self._open, OutputMessage)
                self._open.content.append(OutputText(text=""))
                events.append(self.make("response.content_part.added", item_id=self._open.id,
                                        output_index=self._index, content_index=0, part=OutputText(text="")))
            assert isinstance(self._open, OutputMessage)
            entries = logprobs.get("content") if isinstance(logprobs, dict) else None
            part = self._open.content[0]
            text = delta.content or ""
            part.text += text
            part.logprobs += entries or []
            if text:
                events.append(self.make("response.output_text.delta", item_id=self._open.id,
                                        output_index=self._index, content_index=0, delta=text,
                                        logprobs=entries or []))
        for call in delta.tool_calls or ():
            if call.id is not None:  # a new call
                name = call.function.name if call.function is not None else None
                exposed = (mcp or {}).get(name or "")
                item: FunctionCallOut | McpCallOut | McpApprovalRequestOut
                if exposed is None:
                    item = FunctionCallOut(id=f"fc_{uuid.uuid4().hex}", call_id=call.id, name=name or "",
                                           arguments="", status="in_progress")
                elif exposed.server.needs_approval(exposed.tool):
                    item = McpApprovalRequestOut(id=f"mcpr_{uuid.uuid4().hex}", server_label=exposed.server.label,
                                                 name=exposed.tool.name)
                else:
                    item = McpCallOut(id=f"mcp_{uuid.uuid4().hex}", server_label=exposed.server.label,
                                      name=exposed.tool.name, status="in_progress")
                if exposed is not None and not isinstance(item, FunctionCallOut):
                    self.pending.append((item, call.id, exposed))
                self._calls[call.index] = item
                if not isinstance(item, McpApprovalRequestOut):  # one is offered once its arguments are whole
                    events += self.begin(item)
            item = self._calls[call.index]
            if call.function is not None and call.function.arguments:
                item.arguments += call.function.arguments
                kind = "response.mcp_call_arguments.delta" if isinstance(item, McpCallOut) else \
                    "response.function_call_arguments.delta" if isinstance(item, FunctionCallOut) else None
                if kind is not None:
                    events.append(self.make(kind, item_id=item.id, output_index=self.items.index(item),
                                            delta=call.function.arguments))
        return events

    def offer(self, finish: str | None) -> list[ResponseEvent]:
        """The approval requests of the turn just ended, added now that their arguments are whole; the turn's last
        call, when max_output_tokens ended it, is cut short: never offered, so never run."""
        cut = self.pending[-1] if self.pending and finish == "length" else None
        events: list[ResponseEvent] = []
        for asked in [p for p in self.pending if isinstance(p[0], McpApprovalRequestOut)]:
            if asked is not cut and _json_object(asked[0].arguments or "{}") is not None:
                events += self.begin(asked[0]) + self.close()
            else:
                self.pending.remove(asked)
        return events

    def begin(self, item: OutputItem) -> list[ResponseEvent]:
        events = self.close()
        self.items.append(item)
        self._open = item
        return events + [self.make("response.output_item.added", output_index=self._index,
                                   item=item)]

    def close(self) -> list[ResponseEvent]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        events = []
        if isinstance(item, McpCallOut):  # its item is done once it has run (_run_call)
            return [self.make("response.mcp_call_arguments.done", item_id=item.id, output_index=index,
                              arguments=item.arguments)]
        if isinstance(item, (OutputMessage, FunctionCallOut, ReasoningOut)):
            item.status = "completed"
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events += [self.make("response.output_text.done", item_id=item.id, output_index=index, content_index=0,
                                 text=part.text, logprobs=part.logprobs),
                       self.make("response.content_part.done", item_id=item.id, output_index=index, content_index=0,
                                 part=part)]
        elif isinstance(item, FunctionCallOut):
            events.append(self.make("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                    name=item.name, arguments=item.arguments))
        elif isinstance(item, ReasoningOut):
            events.append(self.make("response.reasoning_text.done", item_id=item.id, output_index=index,
                                    content_index=0, text=item.content[0].text))
        events.append(self.make("response.output_item.done", output_index=index, item=item))
        return events
