"""POST /v1/chat/completions: protocol request in → one GenerationRequest → protocol response out."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from servelm.chat.template import TemplateError
from servelm.engine.types import GenerationRequest, SamplingParams
from servelm.errors import ContextLengthExceeded, InvalidParameter
from servelm.protocol.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessageOut,
    Choice,
    ChunkChoice,
    Delta,
    ImagePart,
)
from servelm.protocol.common import PromptTokensDetails, Usage
from servelm.service.deployments import Deployment, Deployments


@dataclass(frozen=True)
class PreparedChat:
    """A validated request, ready to run: everything that can be a 4xx has been checked."""

    deployment: Deployment
    generation: GenerationRequest
    model: str
    created: int
    stream: bool
    include_usage: bool


class ChatService:
    def __init__(self, deployments: Deployments) -> None:
        self.deployments = deployments

    # -- validation and conversion ----------------------------------------------------------------
    def prepare(self, req: ChatCompletionRequest) -> PreparedChat:
        dep = self.deployments.get(req.model)
        _reject_unsupported(req)
        try:
            text = dep.template.render(_template_messages(req), add_generation_prompt=True)
        except TemplateError as exc:
            raise InvalidParameter(str(exc), "messages") from None
        prompt = dep.tokenize(text)
        params = _sampling_params(req, dep, len(prompt))
        generation = GenerationRequest(f"chatcmpl-{uuid.uuid4().hex}", tuple(prompt), params)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return PreparedChat(dep, generation, req.model, int(time.time()), bool(req.stream), include_usage)

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
        choices = [
            Choice(
                index=i,
                message=ChatMessageOut(content=texts[i]),
                finish_reason=finish[i].finish_reason.value,
                stop_reason=finish[i].stop_reason,
            )
            for i in range(n)
        ]
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

        for i in range(p.generation.params.n):
            yield chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content=""), logprobs=None, finish_reason=None)])
        completion = cached = 0
        async with aclosing(p.deployment.engine.generate(p.generation)) as outputs:
            async for out in outputs:
                cached = out.cached_tokens
                if out.text:
                    yield chunk([ChunkChoice(index=out.index, delta=Delta(content=out.text), logprobs=None, finish_reason=None)])
                if out.finished:
                    completion += out.completion_tokens
                    yield chunk([
                        ChunkChoice(
                            index=out.index,
                            delta=Delta(),
                            logprobs=None,
                            finish_reason=out.finish_reason.value,
                            stop_reason=out.stop_reason,
                        )
                    ])
        if p.include_usage:
            yield chunk([], usage=_usage(len(p.generation.prompt_token_ids), completion, cached))


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
    if req.response_format is not None and req.response_format.type != "text":
        raise InvalidParameter(
            f"response_format of type {req.response_format.type!r} is not supported by this server yet.",
            "response_format",
            "unsupported_parameter",
        )
    if req.tools:
        raise InvalidParameter("tools are not supported by this server yet.", "tools", "unsupported_parameter")
    if req.tool_choice not in (None, "none"):
        raise InvalidParameter("tool_choice requires tools, which are not supported yet.", "tool_choice", "unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise InvalidParameter("stream_options is only allowed when stream is true.", "stream_options")
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        raise InvalidParameter(
            "stream_options.continuous_usage_stats is not supported.", "stream_options.continuous_usage_stats", "unsupported_parameter"
        )


def _template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        if m.role == "tool" or m.tool_calls:
            raise InvalidParameter("tool messages are not supported by this server yet.", f"messages[{i}]", "unsupported_parameter")
        if isinstance(m.content, list):
            parts = []
            for j, part in enumerate(m.content):
                if isinstance(part, ImagePart):
                    raise InvalidParameter(
                        "This model does not accept image input; send text parts only.",
                        f"messages[{i}].content[{j}]",
                        "unsupported_content",
                    )
                parts.append(part.text)
            content = "\n".join(parts)
        else:
            content = m.content or ""
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        messages.append(msg)
    return messages


def _sampling_params(req: ChatCompletionRequest, dep: Deployment, prompt_len: int) -> SamplingParams:
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
