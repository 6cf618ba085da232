"""POST /v1/chat/completions: protocol request in → one GenerationRequest → protocol response out."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from servelm.chat.template import TemplateError
from servelm.chat.tools import CallStart, ContentEvent, ToolCallParser, ToolFormat, parse_tool_calls
from servelm.engine.types import FinishReason, GenerationOutput, GenerationRequest, TokenLogprob
from servelm.errors import InvalidParameter
from servelm.protocol.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessageOut,
    Choice,
    ChunkChoice,
    Delta,
    DeltaFunction,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
)
from servelm.protocol.common import PromptTokensDetails, Usage
from servelm.service.choices import Collector, SeqResult, streams_live
from servelm.service.deployments import Deployment, Deployments
from servelm.service.logprobs import chat_logprobs
from servelm.service.params import EndpointParams, RequestContext, cache_scope, sampling_params
from servelm.service.structured import ToolPlan, plan_output, template_messages


@dataclass(frozen=True)
class PreparedChat:
    """A validated request, ready to run: everything that can be a 4xx has been checked."""

    deployment: Deployment
    generation: GenerationRequest
    model: str
    created: int
    stream: bool
    include_usage: bool
    tools: ToolPlan | None = None  # set when the answer may hold tool calls

    @property
    def generations(self) -> tuple[GenerationRequest, ...]:
        return (self.generation,)


class ChatService:
    def __init__(self, deployments: Deployments) -> None:
        self.deployments = deployments

    # -- validation and conversion ----------------------------------------------------------------
    def prepare(self, req: ChatCompletionRequest, ctx: RequestContext = RequestContext()) -> PreparedChat:
        dep = self.deployments.generator(req.model)
        _reject_unsupported(req)
        output = plan_output(req, dep)
        messages = template_messages(req, output, dep.tool_style.native)
        extra = {"tools": output.template_tools} if output.template_tools else {}
        prompt = prompt_ids(dep, messages, extra)
        ep = EndpointParams(
            max_tokens=req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
            max_tokens_param="max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            # a tool syntax whose markers are control tokens needs their text to be parsed
            skip_special_default=not (output.tools and output.tools.format.special),
            constrained=output.constraint is not None,
        )
        params = sampling_params(req, dep, len(prompt), ep)
        generation = GenerationRequest(f"chatcmpl-{uuid.uuid4().hex}", tuple(prompt), params, output.constraint,
                                       cache_scope(ctx.owner, req.cache_salt))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return PreparedChat(dep, generation, dep.name, int(time.time()), bool(req.stream), include_usage, output.tools)

    # -- running ----------------------------------------------------------------------------------
    async def complete(self, p: PreparedChat) -> ChatCompletion:
        collector = Collector(p.generation.params)
        async with aclosing(p.deployment.engine.generate(p.generation)) as outputs:
            async for out in outputs:
                collector.add(out)
        choices = [self._choice(p, i, r) for i, r in enumerate(collector.chosen())]
        return ChatCompletion(
            id=p.generation.request_id,
            created=p.created,
            model=p.model,
            system_fingerprint=p.deployment.fingerprint,
            choices=choices,
            usage=_usage(len(p.generation.prompt_token_ids), collector.completion_tokens, collector.cached_tokens),
        )

    def _choice(self, p: PreparedChat, index: int, r: SeqResult) -> Choice:
        out = r.final
        reason = out.finish_reason.value
        message = ChatMessageOut(content=r.text)
        if p.tools is not None:
            content, calls = parse_tool_calls(p.tools.format, r.text)
            if calls:
                message = ChatMessageOut(
                    content=content,
                    tool_calls=[ToolCallOut(id=new_call_id(), function=FunctionCallOut(name=n, arguments=a)) for n, a in calls],
                )
                if out.finish_reason is FinishReason.STOP:
                    reason = "tool_calls"
        return Choice(index=index, message=message, finish_reason=reason, stop_reason=out.stop_reason,
                      logprobs=self._logprobs(p, r.logprobs))

    @staticmethod
    def _logprobs(p: PreparedChat, entries: list[TokenLogprob] | None) -> dict | None:
        if p.generation.params.logprobs is None:
            return None
        return chat_logprobs(entries or [], p.deployment.token_bytes)

    async def stream(self, p: PreparedChat) -> AsyncIterator[ChatCompletionChunk]:
        def chunk(choices: list[ChunkChoice], **usage: Any) -> ChatCompletionChunk:
            extra = {"usage": None} if p.include_usage else {}
            extra.update(usage)
            return ChatCompletionChunk(
                id=p.generation.request_id,
                object="chat.completion.chunk",
                created=p.created,
                model=p.model,
                system_fingerprint=p.deployment.fingerprint,
                choices=choices,
                **extra,
            )

        params = p.generation.params
        n = params.n
        streams = [ToolCallStream(p.tools.format) if p.tools else None for _ in range(n)]
        for i in range(n):
            yield chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content=""), logprobs=None, finish_reason=None)])
        collector = Collector(params)
        live = streams_live(params)
        async with aclosing(p.deployment.engine.generate(p.generation)) as outputs:
            async for out in outputs:
                collector.add(out)
                if live:
                    for c in self._chunk_choices(p, out.index, streams[out.index], out.text, out.logprobs, out):
                        yield chunk([c])
        if not live:  # best_of > n or beam search: a choice is known only once every sequence has ended
            for i, r in enumerate(collector.chosen()):
                for c in self._chunk_choices(p, i, streams[i], r.text, r.logprobs, r.final):
                    yield chunk([c])
        if p.include_usage:
            usage = _usage(len(p.generation.prompt_token_ids), collector.completion_tokens, collector.cached_tokens)
            yield chunk([], usage=usage)

    def _chunk_choices(self, p: PreparedChat, index: int, ts: ToolCallStream | None, text: str,
                       entries: list[TokenLogprob] | None, out: GenerationOutput | None) -> list[ChunkChoice]:
        """One piece of a choice as chunk choices: its deltas (the first carries the logprobs), then the
        finish when `out` is final."""
        deltas = ts.feed(text) if ts else ([Delta(content=text)] if text else [])
        final = out is not None and out.finished
        if final and ts:
            deltas += ts.finish()
        logprobs = self._logprobs(p, entries) if entries else None
        if logprobs is not None and not deltas and not final:
            deltas = [Delta()]  # tokens that add no text yet still report their logprobs
        choices = []
        for delta in deltas:
            choices.append(ChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=None))
            logprobs = None
        if final:
            reason = out.finish_reason.value
            if ts and ts.has_calls and out.finish_reason is FinishReason.STOP:
                reason = "tool_calls"
            choices.append(ChunkChoice(index=index, delta=Delta(), logprobs=logprobs, finish_reason=reason,
                                       stop_reason=out.stop_reason))
        return choices


class ToolCallStream:
    """One streamed choice's text → deltas: content, or tool calls whose arguments arrive in pieces."""

    def __init__(self, fmt: ToolFormat) -> None:
        self._parser = ToolCallParser(fmt)

    @property
    def has_calls(self) -> bool:
        return bool(self._parser.calls)

    def feed(self, text: str) -> list[Delta]:
        return self._deltas(self._parser.feed(text)) if text else []

    def finish(self) -> list[Delta]:
        return self._deltas(self._parser.finish())

    @staticmethod
    def _deltas(events: list[Any]) -> list[Delta]:
        deltas: list[Delta] = []
        for e in events:
            if isinstance(e, ContentEvent):
                deltas.append(Delta(content=e.text))
            elif isinstance(e, CallStart):
                call = DeltaToolCall(index=e.index, id=new_call_id(), type="function",
                                     function=DeltaFunction(name=e.name, arguments=""))
                deltas.append(Delta(tool_calls=[call]))
            else:
                deltas.append(Delta(tool_calls=[DeltaToolCall(index=e.index, function=DeltaFunction(arguments=e.text))]))
        return deltas


def prompt_ids(dep: Deployment, messages: list[dict[str, Any]], extra: dict[str, Any]) -> list[int]:
    """The chat prompt's token ids: the messages rendered with the deployment's template, its control tokens the
    template's own (the request's text stays text: chat/markers.py)."""
    markers = dep.markers
    if markers is not None:
        messages, extra = markers.escape(messages), markers.escape(extra)
    try:
        text = dep.template.render(messages, add_generation_prompt=True, **extra)  # type: ignore[union-attr]
    except TemplateError as exc:
        raise InvalidParameter(str(exc), "messages") from None
    if markers is None or dep.tokenize_bare is None:
        return dep.tokenize(text)
    bare = dep.tokenize_bare
    return markers.tokenize(text, lambda piece: bare(piece, False), dep.bos_id)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _usage(prompt: int, completion: int, cached: int) -> Usage:
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _reject_unsupported(req: ChatCompletionRequest) -> None:
    """Parts of the contract not served yet answer 400, never a silently different result."""
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidParameter("top_logprobs requires logprobs to be true.", "top_logprobs")
    if req.stream_options is not None and not req.stream:
        raise InvalidParameter("stream_options is only allowed when stream is true.", "stream_options")
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        raise InvalidParameter(
            "stream_options.continuous_usage_stats is not supported.", "stream_options.continuous_usage_stats", "unsupported_parameter"
        )
