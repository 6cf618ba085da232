"""POST /v1/completions (legacy): each prompt of the batch → one GenerationRequest, run together → choices
indexed prompt_index * n + j, as one text_completion object or a stream of them."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from servelm.aio import gather_all, merge
from servelm.engine.types import GenerationOutput, GenerationRequest, TokenLogprob
from servelm.errors import InvalidParameter, ServerError
from servelm.protocol.common import PromptTokensDetails, Usage
from servelm.protocol.completions import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest
from servelm.service.choices import Collector, SeqResult, streams_live
from servelm.service.logprobs import legacy_logprobs, vllm_prompt_logprobs
from servelm.service.params import (
    EndpointParams,
    RequestContext,
    cache_hint,
    cache_scope,
    request_adapters,
    request_priority,
    sampling_params,
)
from servelm.service.registry.deployments import Deployments, TextDeployment
from servelm.service.safety.content_filter import PromptText, Screening, choice_results, generate

DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy default


@dataclass(frozen=True)
class PromptJob:
    """One prompt of the batch, ready to run."""

    generation: GenerationRequest
    echo: str = ""  # the prompt's text, put ahead of each choice's text (empty without echo)
    head: int = 0  # prompt tokens ahead of the text (the BOS the tokenizer adds): none of the echo's characters


@dataclass(frozen=True)
class PreparedCompletion:
    deployment: TextDeployment
    request_id: str
    jobs: tuple[PromptJob, ...]
    model: str
    created: int
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs asked for: each choice carries them
    screening: Screening | None = None  # its deployment's content policy, applied to this request

    @property
    def generations(self) -> tuple[GenerationRequest, ...]:
        return tuple(job.generation for job in self.jobs)


@dataclass
class PromptParts:
    """A prompt's token ids in three parts; truncation cuts `body` from the left and keeps the rest whole."""

    head: list[int]  # the BOS the tokenizer adds, the FIM prefix marker
    body: list[int]  # the prompt's own tokens
    tail: list[int] = field(default_factory=list)  # FIM: suffix marker, the suffix's tokens, middle marker
    cut: int = 0  # tokens cut from the body's start

    @property
    def ids(self) -> list[int]:
        return [*self.head, *self.body, *self.tail]


class CompletionService:
    operation = "text_completion"  # its GenAI operation name (traces)

    def __init__(self, deployments: Deployments, default_max_tokens: int | None = DEFAULT_MAX_TOKENS) -> None:
        """default_max_tokens: used when a request gives none (None: up to the context window, as OVMS does)."""
        self.deployments = deployments
        self.default_max_tokens = default_max_tokens

    # -- validation and conversion ----------------------------------------------------------------
    def prepare(self, req: CompletionRequest, ctx: RequestContext = RequestContext()) -> PreparedCompletion:
        dep = self.deployments.generator(req.model)  # 404 unknown, 400 embedding-only
        _reject_unsupported(req, dep)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        jobs = []
        prompts = _prompts(req.prompt)
        if len(prompts) > ctx.max_batch_prompts:
            raise InvalidParameter(f"prompt holds {len(prompts)} prompts; this server takes at most "
                                   f"{ctx.max_batch_prompts} in one request.", "prompt", "too_many_prompts")
        for i, prompt in enumerate(prompts):
            parts = _parts(prompt, req, dep)
            max_tokens = _fit(parts, req, dep.context_window, self.default_max_tokens)
            ids = parts.ids
            ep = EndpointParams(
                max_tokens=max_tokens,
                prompt_param="prompt",
                logprobs=req.logprobs,
                prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None,
            )
            params = sampling_params(req, dep, len(ids), ep)
            echo = _echo_text(prompt, parts, dep) if req.echo else ""
            scope = cache_scope(ctx.owner, req.cache_salt)
            jobs.append(PromptJob(GenerationRequest(f"{request_id}-{i}", tuple(ids), params, cache_scope=scope,
                                                    cache_hint=cache_hint(scope, req.prompt_cache_key),
                                                    priority=request_priority(req, dep, ctx),
                                                    adapters=request_adapters(req, dep), tenant=ctx.tenant), echo,
                                 len(parts.head)))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        texts = [_prompt_texts(prompt, i if len(prompts) > 1 else None, req.suffix, dep) for i, prompt in enumerate(prompts)]
        screening = Screening.of(dep, self.deployments, texts, cache_scope(ctx.owner, req.cache_salt), ctx.on_filtered)
        name = req.model if dep.adapters is not None and req.model in dep.adapters else dep.name  # vLLM: the adapter
        return PreparedCompletion(dep, request_id, tuple(jobs), name, int(time.time()), bool(req.stream),
                                  include_usage, bool(req.echo), req.logprobs, req.prompt_logprobs is not None, screening)

    # -- running ----------------------------------------------------------------------------------
    async def complete(self, p: PreparedCompletion) -> Completion:
        async def run(i: int, job: PromptJob) -> Collector:
            col = Collector(job.generation.params)
            async with aclosing(generate(p.deployment.engine, job.generation, p.screening, i)) as outputs:
                async for out in outputs:
                    col.add(out)
            return col

        collectors = await gather_all([run(i, job) for i, job in enumerate(p.jobs)])
        choices = []
        for i, (job, col) in enumerate(zip(p.jobs, collectors)):
            n = job.generation.params.n
            for j, seq in enumerate(col.chosen()):
                choices.append(_whole_choice(p, job, col, i * n + j, seq, _choice_results(p, i, seq.final)))
        extra = {"prompt_filter_results": p.screening.prompt_results} if p.screening is not None else {}
        return Completion(id=p.request_id, created=p.created, model=p.model, system_fingerprint=p.deployment.fingerprint,
                          choices=choices, usage=_usage(p, collectors), **extra)

    async def stream(self, p: PreparedCompletion) -> AsyncGenerator[Completion, None]:
        collectors: list[Collector] = []
        if p.screening is not None:  # as Azure OpenAI: the prompts' results in a first chunk of no choices
            yield _chunk(p, [], prompt_filter_results=p.screening.prompt_results)
        async with aclosing(merge([self._stream_one(p, i, job, collectors) for i, job in enumerate(p.jobs)])) as chunks:
            async for chunk in chunks:
                yield chunk
        if p.include_usage:
            yield _chunk(p, [], usage=_usage(p, collectors))

    async def _stream_one(self, p: PreparedCompletion, i: int, job: PromptJob, done: list[Collector]) -> AsyncGenerator[Completion, None]:
        params = job.generation.params
        col = Collector(params)
        base = i * params.n
        live = streams_live(params)
        states = [_LiveChoice() for _ in col.seqs]
        async with aclosing(generate(p.deployment.engine, job.generation, p.screening, i)) as outputs:
            async for out in outputs:
                col.add(out)
                if live:
                    choice = states[out.index].feed(p, job, col, base + out.index, out, _choice_results(p, i, out))
                    if choice is not None:
                        yield _chunk(p, [choice])
        if not live:  # best_of > n or beam search: a choice is known only once every sequence has ended
            for j, seq in enumerate(col.chosen()):
                yield _chunk(p, [_whole_choice(p, job, col, base + j, seq, _choice_results(p, i, seq.final))])
        done.append(col)


@dataclass
class _LiveChoice:
    """One streamed choice: whether its first chunk (which carries the echo) went out, and where its
    logprobs' text offsets stand."""

    started: bool = False
    offset: int = 0  # the text offset of the choice's next token
    length: int = 0  # characters sent so far

    def feed(self, p: PreparedCompletion, job: PromptJob, col: Collector, index: int, out: GenerationOutput,
             extra: dict[str, Any]) -> CompletionChoice | None:
        first = not self.started
        if not first and not out.text and not out.token_ids and not out.finished:
            return None
        self.started = True
        text = (job.echo if first else "") + out.text
        logprobs = None
        if p.logprobs is not None:
            text_len = self.length + len(text) if out.finished else None
            parts = []
            if first:
                self.offset = len(job.echo)
                if p.echo:
                    parts.append(_prompt_logprobs(p, job, col, len(job.echo)))
            entries = _entries(out.token_ids, out.logprobs)
            gen, self.offset = legacy_logprobs(out.token_ids, entries, p.deployment.vocab.token_bytes, self.offset, text_len)
            logprobs = _join([*parts, gen])
        self.length += len(text)
        return CompletionChoice(
            index=index, text=text, logprobs=logprobs,
            finish_reason=out.finish_reason.value if out.finish_reason is not None else None,
            stop_reason=out.stop_reason if out.finished else None, **extra,
        )


def _whole_choice(p: PreparedCompletion, job: PromptJob, col: Collector, index: int, seq: SeqResult,
                  annotated: dict[str, Any] | None = None) -> CompletionChoice:
    text = job.echo + seq.text
    logprobs = None
    if p.logprobs is not None:
        parts = [_prompt_logprobs(p, job, col, len(job.echo))] if p.echo else []
        entries = _entries(seq.token_ids, seq.logprobs)
        gen, _ = legacy_logprobs(seq.token_ids, entries, p.deployment.vocab.token_bytes, len(job.echo), len(text))
        logprobs = _join([*parts, gen])
    final = seq.final
    extra = dict(annotated or {})
    if p.prompt_logprobs:
        extra["prompt_logprobs"] = vllm_prompt_logprobs(job.generation.prompt_token_ids, col.prompt_logprobs,
                                                        p.deployment.vocab.token_bytes)
    return CompletionChoice(
        index=index, text=text, logprobs=logprobs,
        finish_reason=final.finish_reason.value if final and final.finish_reason else None,
        stop_reason=final.stop_reason if final else None, **extra,
    )


def _choice_results(p: PreparedCompletion, prompt: int, out: GenerationOutput | None) -> dict[str, Any]:
    return choice_results(p.screening, out.index, prompt) if out is not None else {}


def _prompt_texts(prompt: str | list[int], index: int | None, suffix: str | None, dep: TextDeployment) -> list[PromptText]:
    """What an input check reads of one prompt of the batch (token ids as their text), and the suffix."""
    text = prompt if isinstance(prompt, str) else b"".join(dep.vocab.token_bytes(t) for t in prompt).decode(
        "utf-8", errors="replace")
    texts = [PromptText("prompt" if index is None else f"prompt[{index}]", "user", text)]
    return texts + [PromptText("suffix", "user", suffix)] if suffix else texts


def _prompt_logprobs(p: PreparedCompletion, job: PromptJob, col: Collector, text_len: int) -> dict[str, Any]:
    prompt = job.generation.prompt_token_ids
    entries = col.prompt_logprobs
    if entries is None or len(entries) != len(prompt):
        raise ServerError("The engine did not report the prompt's logprobs.")
    out, _ = legacy_logprobs(prompt, entries, p.deployment.vocab.token_bytes, 0, text_len, zero_width=job.head)
    return out


def _entries(token_ids: list[int], logprobs: list[TokenLogprob] | None) -> list[TokenLogprob]:
    entries = logprobs or []
    if len(entries) != len(token_ids):
        raise ServerError(f"The engine reported logprobs for {len(entries)} of {len(token_ids)} tokens.")
    return entries


def _join(parts: list[dict[str, Any]]) -> CompletionLogprobs:
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return CompletionLogprobs(**{k: [v for part in parts for v in part[k]] for k in keys})


def _chunk(p: PreparedCompletion, choices: list[CompletionChoice], **usage: Any) -> Completion:
    extra: dict[str, Any] = {"usage": None} if p.include_usage else {}
    extra.update(usage)
    return Completion(id=p.request_id, object="text_completion", created=p.created, model=p.model,
                      system_fingerprint=p.deployment.fingerprint, choices=choices, **extra)


def _usage(p: PreparedCompletion, collectors: list[Collector]) -> Usage:
    prompt = sum(len(job.generation.prompt_token_ids) for job in p.jobs)
    completion = sum(c.completion_tokens for c in collectors)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(c.cached_tokens for c in collectors)))


# -- prompts --------------------------------------------------------------------------------------
def _prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """The batch: a string, a list of strings, a list of token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidParameter("prompt must not be an empty list.", "prompt")
    if isinstance(prompt[0], list):
        for i, ids in enumerate(prompt):
            if not ids:
                raise InvalidParameter(f"prompt[{i}] must not be an empty list of token ids.", "prompt")
        return list(prompt)
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def _parts(prompt: str | list[int], req: CompletionRequest, dep: TextDeployment) -> PromptParts:
    raw = bool(req.use_raw_prompt)
    bare = dep.vocab.tokenize_bare
    if isinstance(prompt, list):
        for t in prompt:
            if not 0 <= t < dep.vocab.size:
                raise InvalidParameter(f"prompt has token id {t}, outside the vocabulary (0..{dep.vocab.size - 1}).", "prompt")
        parts = PromptParts([], list(prompt))
    elif raw:  # the text's own tokens: no BOS, special-token text read as plain text
        parts = PromptParts([], bare(prompt, False))
    elif req.suffix:
        lead = dep.vocab.tokenize("")  # the BOS the model asks for, if any
        parts = PromptParts(lead, bare(prompt, True))
    else:  # OpenAI's: the model's BOS if it asks for one, special-token text read as those tokens
        ids = dep.vocab.tokenize(prompt)
        lead = dep.vocab.tokenize("")  # the BOS the model asks for, if any
        head = lead if ids[: len(lead)] == lead else []
        parts = PromptParts(head, ids[len(head):])
    if req.suffix and dep.fim_tokens is not None:  # fill-in-the-middle: [BOS] PRE prompt SUF suffix MID
        pre, suf, mid = dep.fim_tokens  # (a suffix without them is a 400: _reject_unsupported)
        parts = PromptParts([*parts.head, pre], parts.body, [suf, *bare(req.suffix, not raw), mid])
    if not parts.ids:
        raise InvalidParameter("prompt must contain at least one token; this one has none.", "prompt")
    return parts


def _fit(parts: PromptParts, req: CompletionRequest, window: int, default: int | None = DEFAULT_MAX_TOKENS) -> int | None:
    """error_behavior "truncate": cut the prompt's own tokens from the left until prompt + max_tokens fits the
    context window, keeping at least one of them; a max_tokens too large for that is lowered. Returns the
    max_tokens to use ("error", or a prompt that fits: the one asked for; sampling_params judges)."""
    max_tokens = req.max_tokens if req.max_tokens is not None else default
    if max_tokens is None:  # up to the window: truncation keeps room for one token
        if req.error_behavior != "truncate" or len(parts.ids) < window:
            return None
        max_tokens = 1
    if req.error_behavior != "truncate" or len(parts.ids) + max_tokens <= window:
        return max_tokens
    fixed = len(parts.head) + len(parts.tail)
    keep_min = min(len(parts.body), 1)
    if fixed + keep_min + 1 > window:  # not even one completion token fits: sampling_params says why
        return max_tokens
    max_tokens = min(max_tokens, window - fixed - keep_min)
    keep = window - fixed - max_tokens
    parts.cut = len(parts.body) - keep
    parts.body = parts.body[parts.cut:]
    return max_tokens


def _echo_text(prompt: str | list[int], parts: PromptParts, dep: TextDeployment) -> str:
    """The text echoed: a text prompt as given (what is left of it when truncated); token ids detokenized."""
    if isinstance(prompt, str) and not parts.cut:
        return prompt
    tokens = parts.body if isinstance(prompt, str) else parts.ids
    return b"".join(dep.vocab.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")


def _reject_unsupported(req: CompletionRequest, dep: TextDeployment) -> None:
    if req.chat_template_kwargs is not None:
        raise InvalidParameter("chat_template_kwargs applies to chat requests: a completion's prompt is not rendered "
                               "with the chat template.", "chat_template_kwargs", "unsupported_parameter")
    if req.timings_per_request:
        raise InvalidParameter("timings_per_request is served on chat completions, Responses and Messages.",
                               "timings_per_request", "unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise InvalidParameter("stream_options is only allowed when stream is true.", "stream_options")
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        raise InvalidParameter(
            "stream_options.continuous_usage_stats is not supported.", "stream_options.continuous_usage_stats", "unsupported_parameter"
        )
    if req.suffix:
        if req.echo:
            raise InvalidParameter("echo cannot be used together with suffix.", "echo")
        if dep.fim_tokens is None:
            raise InvalidParameter(
                f"suffix is not supported: the model `{dep.name}` has no fill-in-the-middle tokens.", "suffix", "unsupported_parameter"
            )
