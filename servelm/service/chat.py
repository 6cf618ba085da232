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
from servelm.engine.types import FinishReason, GenerationOutput, GenerationRequest, SamplingParams
from servelm.errors import ContextLengthExceeded, InvalidParameter
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
from servelm.service.deployments import Deployment, Deployments
from servelm.service.structured import OutputPlan, ToolPlan, plan_output, template_messages


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


class ChatService:
    def __init__(self, deployments: Deployments) -> None:
        self.deployments = deployments

    # -- validation and conversion ----------------------------------------------------------------
    def prepare(self, req: ChatCompletionRequest) -> PreparedChat:
        dep = self.deployments.get(req.model)
        _reject_unsupported(req)
        output = plan_output(req, dep)
        messages = template_messages(req, output, dep.tool_style.native)
        extra = {"tools": output.template_tools} if output.template_tools else {}
        try:
            text = dep.template.render(messages, add_generation_prompt=True, **extra)
        except TemplateError as exc:
            raise InvalidParameter(str(exc), "messages") from None
        prompt = dep.tokenize(text)
        params = _sampling_params(req, dep, len(prompt), output)
        generation = GenerationRequest(f"chatcmpl-{uuid.uuid4().hex}", tuple(prompt), params, output.constraint)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return PreparedChat(dep, generation, req.model, int(time.time()), bool(req.stream), include_usage, output.tools)

    # -- running ----------------------------------------------------------------------------------
    async def complete(self, p: PreparedChat) -> ChatCompletion:
        n = p.generation.params.n
        texts = [""] * n
        finish: list[Any] = [None] * n
        completion = cached = 0
        async with aclosing(p.deployment.engine.generate(p.generation)) as outputs:
            async for out in outputs:
                texts[out.index] += out.text
                cached = out.cached_tokens
                if out.finished:
                    finish[out.index] = out
                    completion += out.completion_tokens
        choices = [_choice(i, texts[i], finish[i], p.tools) for i in range(n)]
        return ChatCompletion(
            id=p.generation.request_id,
            created=p.created,
            model=p.model,
            system_fingerprint=p.deployment.fingerprint,
            choices=choices,
            usage=_usage(len(p.generation.prompt_token_ids), completion, cached),
        )

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

        n = p.generation.params.n
        streams = [ToolCallStream(p.tools.format) if p.tools else None for _ in range(n)]
        for i in range(n):
            yield chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content=""), logprobs=None, finish_reason=None)])
        completion = cached = 0
        async with aclosing(p.deployment.engine.generate(p.generation)) as outputs:
            async for out in outputs:
                cached = out.cached_tokens
                ts = streams[out.index]
                deltas = ts.feed(out.text) if ts else ([Delta(content=out.text)] if out.text else [])
                if out.finished and ts:
                    deltas += ts.finish()
                for delta in deltas:
                    yield chunk([ChunkChoice(index=out.index, delta=delta, logprobs=None, finish_reason=None)])
                if out.finished:
                    completion += out.completion_tokens
                    reason = out.finish_reason.value
                    if ts and ts.has_calls and out.finish_reason is FinishReason.STOP:
                        reason = "tool_calls"
                    yield chunk([
                        ChunkChoice(index=out.index, delta=Delta(), logprobs=None, finish_reason=reason,
                                    stop_reason=out.stop_reason)
                    ])
        if p.include_usage:
            yield chunk([], usage=_usage(len(p.generation.prompt_token_ids), completion, cached))


def _choice(index: int, text: str, out: GenerationOutput, tools: ToolPlan | None) -> Choice:
    reason = out.finish_reason.value
    message = ChatMessageOut(content=text)
    if tools is not None:
        content, calls = parse_tool_calls(tools.format, text)
        if calls:
            message = ChatMessageOut(
                content=content,
                tool_calls=[ToolCallOut(id=new_call_id(), function=FunctionCallOut(name=n, arguments=a)) for n, a in calls],
            )
            if out.finish_reason is FinishReason.STOP:
                reason = "tool_calls"
    return Choice(index=index, message=message, finish_reason=reason, stop_reason=out.stop_reason)


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
    if req.logprobs:
        raise InvalidParameter("logprobs are not supported by this server yet.", "logprobs", "unsupported_parameter")
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidParameter("top_logprobs requires logprobs to be true.", "top_logprobs")
    if req.stream_options is not None and not req.stream:
        raise InvalidParameter("stream_options is only allowed when stream is true.", "stream_options")
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        raise InvalidParameter(
            "stream_options.continuous_usage_stats is not supported.", "stream_options.continuous_usage_stats", "unsupported_parameter"
        )


def _sampling_params(req: ChatCompletionRequest, dep: Deployment, prompt_len: int, output: OutputPlan) -> SamplingParams:
    window = dep.context_window
    n = req.n or 1
    if n > dep.max_choices:
        raise InvalidParameter(f"n must be at most {dep.max_choices} on this deployment; got {n}.", "n")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    if max_tokens is None:
        if prompt_len >= window:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {window} tokens. However, your messages resulted in "
                f"{prompt_len} tokens. Please reduce the length of the messages."
            )
        max_tokens = window - prompt_len
    elif prompt_len + max_tokens > window:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {window} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the completion "
            f"({param})). Please reduce the length of the messages or completion."
        )
    if req.min_tokens is not None and req.min_tokens > max_tokens:
        raise InvalidParameter(f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens}).", "min_tokens")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if any(s == "" for s in stop):
        raise InvalidParameter("stop strings must not be empty.", "stop")
    for t in req.stop_token_ids or ():
        if t >= dep.vocab_size:
            raise InvalidParameter(f"stop_token_ids has {t}, outside the vocabulary (0..{dep.vocab_size - 1}).", "stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k in (None, -1) else req.top_k,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=_logit_bias(req.logit_bias, dep.vocab_size),
        stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=bool(req.ignore_eos),
        min_tokens=req.min_tokens or 0,
        n=n,
        # a tool syntax whose markers are control tokens needs their text to be parsed
        skip_special_tokens=not (output.tools and output.tools.format.special),
    )


def _logit_bias(bias: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    out = []
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidParameter(f"logit_bias keys must be token ids; got {key!r}.", "logit_bias") from None
        if not 0 <= token < vocab:
            raise InvalidParameter(f"logit_bias has token id {token}, outside the vocabulary (0..{vocab - 1}).", "logit_bias")
        out.append((token, float(value)))
    return tuple(out)
