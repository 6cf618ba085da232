"""POST /v1/chat/completions: protocol request in → one GenerationRequest → protocol response out."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from servelm.chat.reasoning import ReasoningMarkers, ReasoningParser, split_reasoning
from servelm.chat.tools import ArgsEvent, CallEnd, CallStart, ContentEvent, ToolCallParser, ToolFormat, parse_tool_calls
from servelm.engine.types import FinishReason, GenerationOutput, GenerationRequest, Thinking, TokenLogprob
from servelm.errors import InvalidParameter, ServerError
from servelm.metrics import STREAM_CPU_SAMPLE, STREAM_CPU_SECONDS
from servelm.protocol.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    ChatMessageOut,
    Choice,
    ChunkChoice,
    Delta,
    DeltaFunction,
    DeltaToolCall,
    FunctionCallOut,
    NamedFunction,
    NamedToolChoice,
    TextPart,
    Tool,
    ToolCallIn,
    ToolCallOut,
)
from servelm.protocol.common import PromptTokensDetails, Usage
from servelm.service.choices import Collector, SeqResult, streams_live
from servelm.service.logprobs import chat_logprobs, vllm_prompt_logprobs
from servelm.service.media import ModalityNotSupported, Piece
from servelm.service.messages import image_parts, prompt_ids, template_messages
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
from servelm.service.structured import ToolPlan, plan_output


@dataclass(frozen=True)
class PreparedChat:
    """A validated request, ready to run: everything that can be a 4xx has been checked."""

    deployment: TextDeployment
    generation: GenerationRequest
    model: str
    created: int
    stream: bool
    include_usage: bool
    tools: ToolPlan | None = None  # set when the answer may hold tool calls
    legacy_functions: bool = False  # asked with the deprecated `functions`: a call answers as function_call
    reasoning: ReasoningMarkers | None = None  # the answer may begin with a thought between these markers
    timings: bool = False  # the answer carries llama-server's timings
    screening: Screening | None = None  # its deployment's content policy, applied to this request

    @property
    def generations(self) -> tuple[GenerationRequest, ...]:
        return (self.generation,)


class ChatService:
    operation = "chat"  # its GenAI operation name (traces)

    def __init__(self, deployments: Deployments) -> None:
        self.deployments = deployments

    # -- validation and conversion ----------------------------------------------------------------
    def prepare(self, req: ChatCompletionRequest, ctx: RequestContext = RequestContext()) -> PreparedChat:
        dep = self.deployments.generator(req.model)
        _reject_unsupported(req)
        legacy = req.functions is not None
        req = from_functions(req)
        check_tool_answers(req)
        output = plan_output(req, dep)
        images = read_images(dep, req)
        mark = f"\ue002{uuid.uuid4().hex}\ue003" if images else ""  # where each image goes, found again once rendered
        messages = template_messages(req, output.system_text or "", dep.tool_style.native, mark)
        extra = {**template_switches(req, dep), **({"tools": output.template_tools} if output.template_tools else {})}
        prompt, media, rendered = prompt_ids(dep, messages, extra, mark, images)
        ep = EndpointParams(
            max_tokens=req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
            max_tokens_param="max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            # a tool syntax whose markers are control tokens needs their text to be parsed
            skip_special_default=not (output.tools and output.tools.format.special),
            constrained=output.constraint is not None,
        )
        params = sampling_params(req, dep, len(prompt), ep)
        if media and params.prompt_logprobs is not None:
            raise InvalidParameter("prompt_logprobs cannot score a prompt with images (their positions are no "
                                   "tokens).", "prompt_logprobs", "unsupported_parameter")
        scope = cache_scope(ctx.owner, req.cache_salt)
        # a thought is read unless a grammar binds the answer from its first token
        markers = dep.reasoning if output.constraint is None or output.constraint.free_unless else None
        thinking = _thinking(req, dep, markers, prompt)
        generation = GenerationRequest(f"chatcmpl-{uuid.uuid4().hex}", tuple(prompt), params, output.constraint,
                                       scope, cache_hint(scope, req.prompt_cache_key), thinking=thinking, media=media,
                                       priority=request_priority(req, dep, ctx), adapters=request_adapters(req, dep),
                                       tenant=ctx.tenant)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        texts = [prompt_texts(req, rendered)] if dep.content_filter is not None else []
        screening = Screening.of(dep, self.deployments, texts, scope, ctx.on_filtered)
        name = req.model if dep.adapters is not None and req.model in dep.adapters else dep.name  # vLLM: the adapter
        return PreparedChat(dep, generation, name, int(time.time()), bool(req.stream), include_usage, output.tools,
                            legacy, markers, bool(req.timings_per_request or ctx.timings), screening)

    # -- running ----------------------------------------------------------------------------------
    async def complete(self, p: PreparedChat) -> ChatCompletion:
        collector = Collector(p.generation.params)
        watch = ToolCallStream(p.tools.format, p.legacy_functions) if _stops_on_repeat(p) and p.tools else None
        async with aclosing(generate(p.deployment.engine, p.generation, p.screening)) as outputs:
            async for out in outputs:
                collector.add(out)
                if watch is not None and not out.finished:
                    watch.feed(out.text)
                    if watch.repeated:  # every call of the turn is in; the rest would repeat them
                        collector.stop(0)
                        break
        choices = [self._choice(p, i, r) for i, r in enumerate(collector.chosen())]
        extra: dict[str, Any] = {"timings": collector.timings()} if p.timings else {}
        if p.screening is not None:
            extra["prompt_filter_results"] = p.screening.prompt_results
        if p.generation.params.prompt_logprobs is not None:  # vLLM's, at the top as vLLM puts them
            extra["prompt_logprobs"] = vllm_prompt_logprobs(p.generation.prompt_token_ids, collector.prompt_logprobs,
                                                            p.deployment.vocab.token_bytes)
        return ChatCompletion(
            **extra,
            id=p.generation.request_id,
            created=p.created,
            model=p.model,
            system_fingerprint=p.deployment.fingerprint,
            choices=choices,
            usage=_usage(p, collector),
        )

    def _choice(self, p: PreparedChat, index: int, r: SeqResult) -> Choice:
        out = r.final
        if out is None or out.finish_reason is None:
            raise ServerError("The engine ended a choice without saying why.")
        reason: str = out.finish_reason.value
        thought, text = split_reasoning(p.reasoning, _opened(p), r.text) if p.reasoning else ("", r.text)
        message = ChatMessageOut(content=text)
        if p.tools is not None:
            content, calls = parse_tool_calls(p.tools.format, text)
            if calls and p.legacy_functions:  # one call (parallel calls are off), content null, as OpenAI
                name, arguments = calls[0]
                message = ChatMessageOut(function_call=FunctionCallOut(name=name, arguments=arguments))
                if out.finish_reason is FinishReason.STOP:
                    reason = "function_call"
            elif calls:
                message = ChatMessageOut(
                    content=content,
                    tool_calls=[ToolCallOut(id=new_call_id(), function=FunctionCallOut(name=n, arguments=a)) for n, a in calls],
                )
                if out.finish_reason is FinishReason.STOP:
                    reason = "tool_calls"
        if thought:  # under both names: clients read one or the other
            message.reasoning_content = message.reasoning = thought
        return Choice(index=index, message=message, finish_reason=reason, stop_reason=out.stop_reason,
                      logprobs=self._logprobs(p, r.logprobs), **choice_results(p.screening, out.index))

    @staticmethod
    def _logprobs(p: PreparedChat, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if p.generation.params.logprobs is None:
            return None
        return chat_logprobs(entries or [], p.deployment.vocab.token_bytes)

    def stream(self, p: PreparedChat) -> AsyncGenerator[ChatCompletionChunk | bytes, None]:
        """The answer's chunks for the wire: a chunk that only adds text to a choice comes as its JSON already
        (made from a template, byte for byte what the model would serialize to), the others as models."""
        return self._chunks(p, encoded=True)

    def chunks(self, p: PreparedChat) -> AsyncGenerator[ChatCompletionChunk, None]:
        """The answer's chunks, every one a model (for the APIs that read them: Responses, Messages)."""
        return self._chunks(p, encoded=False)  # type: ignore[return-value]  # no bytes when not encoded

    async def _chunks(self, p: PreparedChat, encoded: bool) -> AsyncGenerator[ChatCompletionChunk | bytes, None]:
        templates: dict[int, tuple[bytes, bytes]] = {}  # choice index → its text chunk's JSON around the text
        made_count = 0

        def text_chunk(index: int, text: str) -> bytes:
            nonlocal made_count
            template = templates.get(index)
            if template is None:
                sample = chunk([ChunkChoice(index=index, delta=Delta(content=_MARK), logprobs=None, finish_reason=None)])
                # the last place it stands: only `usage` (null) follows the choices, and a model's name may hold it
                before, _, after = sample.model_dump_json(exclude_unset=True).encode().rpartition(_MARK_JSON)
                template = templates[index] = before, after
            made_count += 1
            timed = made_count % STREAM_CPU_SAMPLE == 0  # sampled, as http/streams.py times their frames
            start = time.thread_time() if timed else 0.0
            # json.dumps escapes a str exactly as pydantic-core does (tests/protocol/test_chunk_templates.py)
            made = template[0] + json.dumps(text, ensure_ascii=False).encode() + template[1]
            if timed:
                STREAM_CPU_SECONDS["serialize"] += (time.thread_time() - start) * STREAM_CPU_SAMPLE
            return made

        def chunk(choices: list[ChunkChoice], **usage: Any) -> ChatCompletionChunk:
            start = time.thread_time()
            extra = {"usage": None} if p.include_usage else {}
            extra.update(usage)
            made = ChatCompletionChunk(
                id=p.generation.request_id,
                object="chat.completion.chunk",
                created=p.created,
                model=p.model,
                system_fingerprint=p.deployment.fingerprint,
                choices=choices,
                **extra,
            )
            STREAM_CPU_SECONDS["serialize"] += time.thread_time() - start
            return made

        params = p.generation.params
        n = params.n
        if p.screening is not None:  # as Azure OpenAI: the prompt's results in a first chunk of no choices
            yield chunk([], prompt_filter_results=p.screening.prompt_results)
        streams = [ToolCallStream(p.tools.format, p.legacy_functions) if p.tools else None for _ in range(n)]
        thoughts = [ReasoningParser(p.reasoning, _opened(p)) if p.reasoning else None for _ in range(n)]
        for i in range(n):
            # as OpenAI: content "" opens a text answer, null one that may hold calls
            opening = Delta(role="assistant", content=None if p.tools else "")
            yield chunk([ChunkChoice(index=i, delta=opening, logprobs=None, finish_reason=None)])
        collector = Collector(params)
        live = streams_live(params)
        watch = streams[0] if _stops_on_repeat(p) else None
        # a chunk of text alone can come from its template: no tool calls or thoughts to parse, no filter results
        plain = encoded and live and p.tools is None and p.reasoning is None and p.screening is None
        async with aclosing(generate(p.deployment.engine, p.generation, p.screening)) as outputs:
            async for out in outputs:
                collector.add(out)
                if plain and not out.logprobs and out.finish_reason is None:  # text alone: the hot path
                    if out.text:
                        yield text_chunk(out.index, out.text)
                elif live:
                    for c in self._chunk_choices(p, out.index, streams[out.index], thoughts[out.index], out.text,
                                                 out.logprobs, out):
                        yield chunk([c])
                if watch is not None and watch.repeated and not out.finished:  # as complete() does
                    collector.stop(0)
                    reason = "function_call" if p.legacy_functions else "tool_calls"
                    yield chunk([ChunkChoice(index=0, delta=Delta(), logprobs=None, finish_reason=reason)])
                    break
        if not live:  # best_of > n or beam search: a choice is known only once every sequence has ended
            for i, r in enumerate(collector.chosen()):
                for c in self._chunk_choices(p, i, streams[i], thoughts[i], r.text, r.logprobs, r.final):
                    yield chunk([c])
        last: dict[str, Any] = {"usage": _usage(p, collector)} if p.include_usage else {}
        if p.timings:  # llama-server's, in a last chunk of their own
            last["timings"] = collector.timings()
        if last:
            yield chunk([], **last)

    def _chunk_choices(self, p: PreparedChat, index: int, ts: ToolCallStream | None, rp: ReasoningParser | None,
                       text: str, entries: list[TokenLogprob] | None, out: GenerationOutput | None) -> list[ChunkChoice]:
        """One piece of a choice as chunk choices: its thought and answer deltas (the first carries the logprobs),
        then the finish when `out` is final."""
        final = out is not None and out.finished
        thought = ""
        if rp is not None:
            thought, text = rp.feed(text)
            if final:
                more_thought, more_text = rp.finish()
                thought, text = thought + more_thought, text + more_text
        deltas = [Delta(reasoning_content=thought, reasoning=thought)] if thought else []
        deltas += ts.feed(text) if ts else ([Delta(content=text)] if text else [])
        if final and ts:
            deltas += ts.finish()
        logprobs = self._logprobs(p, entries) if entries else None
        if logprobs is not None and not deltas and not final:
            deltas = [Delta()]  # tokens that add no text yet still report their logprobs
        choices = []
        annotated = choice_results(p.screening, out.index if out is not None else index)
        for delta in deltas:
            choices.append(ChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=None, **annotated))
            logprobs = None
        if out is not None and out.finish_reason is not None:
            reason: str = out.finish_reason.value
            if ts and ts.has_calls and out.finish_reason is FinishReason.STOP:
                reason = "function_call" if p.legacy_functions else "tool_calls"
            choices.append(ChunkChoice(index=index, delta=Delta(), logprobs=logprobs, finish_reason=reason,
                                       stop_reason=out.stop_reason, **annotated))
        return choices


def prompt_texts(req: ChatCompletionRequest, rendered: str = "") -> list[PromptText]:
    """What an input check reads of a chat request: everything the model will read. Each message's text, named
    `messages[i].content`; each earlier tool call's name and arguments (`messages[i].tool_calls[j]`); each tool's
    definition, its name, description and parameters with their enums (`tools[k]`); then the rendered prompt as a
    whole (`messages`: what the template adds and what a term split across messages spells)."""
    texts = []
    for i, m in enumerate(req.messages):
        content = m.content
        text = "\n".join(part.text for part in content if isinstance(part, TextPart)) if isinstance(content, list) \
            else content or ""
        if text:
            texts.append(PromptText(f"messages[{i}].content", m.role, text))
        for j, call in enumerate(m.tool_calls or ()):
            texts.append(PromptText(f"messages[{i}].tool_calls[{j}]", "tool_call",
                                    f"{call.function.name} {call.function.arguments}"))
    for k, tool in enumerate(req.tools or ()):
        texts.append(PromptText(f"tools[{k}]", "tool_definition", json.dumps(tool.function.model_dump(
            exclude_none=True), ensure_ascii=False)))
    if rendered:
        texts.append(PromptText("messages", "prompt", rendered))
    return texts



_MARK = "servelm:text-of-the-chunk"  # a text chunk's template is a chunk with this as its text, cut around it
_MARK_JSON = json.dumps(_MARK).encode()


def _stops_on_repeat(p: PreparedChat) -> bool:
    """Whether the answer ends at the first repeated call: a request of one choice that may make calls and does
    not think first (with several choices, one cannot stop alone: repeats are only dropped)."""
    params = p.generation.params
    return p.tools is not None and p.reasoning is None and params.n == 1 and streams_live(params)


def _opened(p: PreparedChat) -> bool:
    """Whether the prompt opened the thought (a template that writes the opening marker itself)."""
    return p.generation.thinking is not None and p.generation.thinking.opened


# what each reasoning_effort allows the thought, in tokens (None: no bound)
EFFORT_BUDGETS: dict[str, int | None] = {"minimal": 64, "low": 512, "medium": 2048, "high": None}
_RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


def template_switches(req: ChatCompletionRequest, dep: TextDeployment) -> dict[str, Any]:
    """The chat template's keyword switches: chat_template_kwargs, and the thinking switch (`enable_thinking`)
    that reasoning_effort sets unless they set it."""
    kwargs = dict(req.chat_template_kwargs or {})
    for name in _RESERVED:
        if name in kwargs:
            raise InvalidParameter(f"chat_template_kwargs may not set {name!r}.", "chat_template_kwargs")
    effort = req.reasoning_effort
    if dep.reasoning is None:  # a model that does not think: effort and budget change nothing (as vLLM takes them)
        return kwargs
    if effort is not None:
        kwargs.setdefault("enable_thinking", effort != "none")
    return kwargs


def _thinking(req: ChatCompletionRequest, dep: TextDeployment, markers: ReasoningMarkers | None,
              prompt: list[int]) -> Thinking | None:
    """What the engine is told of the thought: its markers, whether the prompt opened it, and its budget
    (thinking_budget, else reasoning_effort's)."""
    if markers is None:
        return None
    budget = req.thinking_budget
    if budget is None and req.reasoning_effort is not None:
        budget = 0 if req.reasoning_effort == "none" else EFFORT_BUDGETS[req.reasoning_effort]
    tail = b"".join(dep.vocab.token_bytes(t) for t in prompt[-16:]).decode("utf-8", "replace")
    close_ids = tuple(dep.vocab.tokenize_bare(markers.close, True))
    return Thinking(markers.open.encode(), markers.close.encode(), close_ids, tail.rstrip().endswith(markers.open),
                    budget)


class ToolCallStream:
    """One streamed choice's text → deltas: content, or tool calls. The first call streams as its arguments come;
    a later one is sent whole once its arguments end, or dropped when it repeats an earlier call of the turn (a
    small model allowed parallel calls may repeat one call until max_tokens: `repeated` tells the caller to stop
    the choice there). A later call that max_tokens cuts off is never sent."""

    def __init__(self, fmt: ToolFormat, legacy: bool = False) -> None:
        self._parser = ToolCallParser(fmt)
        self._legacy = legacy  # deltas of the deprecated function_call shape
        self._sent: list[tuple[str, str]] = []  # the whole calls sent (or being sent: the first)
        self.has_calls = False
        self.repeated = False

    def feed(self, text: str) -> list[Delta]:
        return self._deltas(self._parser.feed(text)) if text else []

    def finish(self) -> list[Delta]:
        return self._deltas(self._parser.finish())

    def _deltas(self, events: list[Any]) -> list[Delta]:
        deltas: list[Delta] = []
        for e in events:
            if isinstance(e, ContentEvent):
                deltas.append(Delta(content=e.text))
            elif isinstance(e, CallStart) and e.index == 0:
                self.has_calls = True
                deltas.append(self._call(0, e.name, ""))
            elif isinstance(e, ArgsEvent) and e.index == 0:
                deltas.append(self._args(0, e.text))
            elif isinstance(e, CallEnd):
                call = self._parser.calls[e.index]
                if call in self._sent:
                    self.repeated = True
                    continue
                self._sent.append(call)
                if e.index > 0:  # the call whole, in the usual two parts: its header, then its arguments
                    name, arguments = call
                    deltas += [self._call(len(self._sent) - 1, name, ""), self._args(len(self._sent) - 1, arguments)]
        return deltas

    def _call(self, index: int, name: str, arguments: str) -> Delta:
        if self._legacy:
            return Delta(function_call=DeltaFunction(name=name, arguments=arguments))
        return Delta(tool_calls=[DeltaToolCall(index=index, id=new_call_id(), type="function",
                                               function=DeltaFunction(name=name, arguments=arguments))])

    def _args(self, index: int, text: str) -> Delta:
        if self._legacy:
            return Delta(function_call=DeltaFunction(arguments=text))
        return Delta(tool_calls=[DeltaToolCall(index=index, function=DeltaFunction(arguments=text))])


def read_images(dep: TextDeployment, req: ChatCompletionRequest) -> list[list[Piece]]:
    """Each image part's bytes read by the deployment's projector (a 400 naming the part for a bad one)."""
    parts = image_parts(req)
    if parts and dep.images is None:
        raise ModalityNotSupported(dep.name, parts[0][0])
    return [dep.images.read(url, where) for where, url in parts] if dep.images is not None else []


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _usage(p: PreparedChat, collector: Collector) -> Usage:
    prompt, completion = len(p.generation.prompt_token_ids), collector.completion_tokens
    extra = {"completion_tokens_details": {"reasoning_tokens": collector.reasoning_tokens}} if p.reasoning else {}
    return Usage(
        **extra,
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=collector.cached_tokens),
    )


def from_functions(req: ChatCompletionRequest) -> ChatCompletionRequest:
    """The deprecated `functions` API as tools: `functions` → tools, `function_call` → tool_choice, one call a
    turn; in the history an assistant's `function_call` → a tool call, a `function` message → its tool result."""
    if req.functions is not None and (req.tools is not None or req.tool_choice is not None):
        raise InvalidParameter("functions cannot be combined with tools or tool_choice; use tools.", "functions")
    if req.function_call is not None and req.functions is None:
        raise InvalidParameter("function_call requires functions.", "function_call")
    messages: list[ChatMessage] = []
    pending: dict[str, str] = {}  # function name -> the id given to its latest call
    for m in req.messages:
        if m.function_call is not None:
            call_id = f"call_fn_{len(messages)}"
            pending[m.function_call.name] = call_id
            calls = [*(m.tool_calls or ()), ToolCallIn(id=call_id, function=m.function_call)]
            m = m.model_copy(update={"function_call": None, "tool_calls": calls})
        elif m.role == "function":
            m = m.model_copy(update={"role": "tool", "tool_call_id": pending.pop(m.name or "", f"call_fn_{m.name}")})
        messages.append(m)
    update: dict[str, Any] = {"messages": messages, "functions": None, "function_call": None}
    if req.functions is not None:
        choice = req.function_call
        update["tools"] = [Tool(type="function", function=f) for f in req.functions]
        update["tool_choice"] = (NamedToolChoice(type="function", function=choice) if isinstance(choice, NamedFunction)
                                 else choice)
        update["parallel_tool_calls"] = False
    return req.model_copy(update=update)


def check_tool_answers(req: ChatCompletionRequest) -> None:
    """As OpenAI checks: every tool call of an assistant message is answered by a `tool` message with its id
    before the next message of another role."""
    open_calls: dict[str, int] = {}
    for i, m in enumerate(req.messages):
        if m.role == "tool":
            if open_calls.pop(m.tool_call_id or "", None) is None:
                raise InvalidParameter(
                    f"Invalid parameter: a message with role 'tool' must answer a tool call of the assistant "
                    f"message before it; no call has the id {m.tool_call_id!r}.", f"messages.[{i}].tool_call_id")
            continue
        if open_calls:
            raise _unanswered(open_calls, "role")
        for call in m.tool_calls or ():
            open_calls[call.id] = i
    # a conversation may end on the assistant's calls (a client asking the model to go on from them), but not on
    # tool answers that leave some of its calls unanswered
    if open_calls and req.messages and req.messages[-1].role == "tool":
        raise _unanswered(open_calls, "tool_calls")


def _unanswered(open_calls: dict[str, int], field: str) -> InvalidParameter:
    """OpenAI's 400 for tool calls left without an answer, naming `field` of the assistant message that made them."""
    return InvalidParameter(
        f"An assistant message with 'tool_calls' must be followed by tool messages responding to each "
        f"'tool_call_id'. The following tool_call_ids did not have response messages: {', '.join(open_calls)}",
        f"messages.[{next(iter(open_calls.values()))}].{field}")


def _reject_unsupported(req: ChatCompletionRequest) -> None:
    """Parts of the contract not served yet answer 400, never a silently different result."""
    if req.modalities is not None and "audio" in req.modalities or req.audio is not None:
        raise InvalidParameter("This model answers in text only: audio output is not supported; leave out "
                               "`audio` and ask for modalities [\"text\"].",
                               "modalities" if req.audio is None else "audio", "unsupported_parameter")
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidParameter("top_logprobs requires logprobs to be true.", "top_logprobs")
    if req.stream_options is not None and not req.stream:
        raise InvalidParameter("stream_options is only allowed when stream is true.", "stream_options")
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        raise InvalidParameter(
            "stream_options.continuous_usage_stats is not supported.", "stream_options.continuous_usage_stats", "unsupported_parameter"
        )
