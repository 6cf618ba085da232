"""The platform dialects as translations around the OpenAI services: request bodies and headers in, the
same ChatService / CompletionService underneath, the dialect's shapes out. No new engine path.

- Azure ML (`POST /chat/completions?api-version=…`): its parameter contract, the `extra-parameters`
  header, and the `azureml-model-deployment` header.
- SageMaker / DJL LMI (`POST /invocations`): chat, completion, or DJL's native `{"inputs", "parameters"}`.
- OpenVINO Model Server (`/v3/…`): OVMS's defaults where they differ from OpenAI's.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from servelm.aio import gather_all
from servelm.engine.types import FinishReason, GenerationOutput
from servelm.errors import InvalidParameter, UnprocessableContent
from servelm.protocol.completions import CompletionRequest
from servelm.protocol.dialects import DjlDetails, DjlOutput, DjlOutputs, DjlRequest, DjlStreamLine, DjlToken
from servelm.service.base import Translated
from servelm.service.choices import Collector, SeqResult
from servelm.service.completions import CompletionService, PreparedCompletion
from servelm.service.params import RequestContext
from servelm.service.registry.deployments import Deployments, TextDeployment
from servelm.service.safety.content_filter import generate

# -- model routing --------------------------------------------------------------------------------


def default_model(deployments: Deployments) -> str:
    """The default deployment: the first one that generates text."""
    for d in deployments.generators():
        return d.name
    raise InvalidParameter("No deployment on this server generates text.", "model", "model_not_found")


def default_embedding_model(deployments: Deployments) -> str:
    """The default deployment for embeddings: the first embedding-only one, else the first that embeds."""
    embedders = [d for d in deployments.all() if d.embedder is not None]
    for d in sorted(embedders, key=lambda d: isinstance(d, TextDeployment)):
        return d.name
    raise InvalidParameter("No deployment on this server produces embeddings.", "model", "model_not_found")


def route_model(body: dict[str, Any], header: str | None, header_name: str, deployments: Deployments,
                default: Callable[[Deployments], str] = default_model) -> dict[str, Any]:
    """The body with `model` set: the routing header's deployment, else the body's own `model`, else the
    default deployment. A body `model` that disagrees with the header is a 400 (never a silent choice)."""
    model = body.get("model")
    if header:
        if model is not None and model != header:
            raise InvalidParameter(
                f"`model` ({model!r}) names another deployment than the {header_name} header ({header!r}); "
                "give one, or the same in both.", "model", "invalid_value",
            )
        deployments.get(header)  # 404 model_not_found for an unknown deployment
        return {**body, "model": header}
    if model is None:
        return {**body, "model": default(deployments)}
    return body


def sagemaker_target(header: str | None) -> str | None:
    """`X-Amzn-SageMaker-Target-Model` names a model artefact (`name.tar.gz` on a multi-model endpoint)."""
    if not header:
        return None
    return header[: -len(".tar.gz")] if header.endswith(".tar.gz") else header


# -- Azure ML -------------------------------------------------------------------------------------

# The parameters of Azure ML's chat contract (the seed's CreateChatCompletionRequest, plus `model`, which
# Microsoft's client sends). Everything else is an "extra parameter", ours included (top_k, min_p, …).
AZURE_CHAT_PARAMS = frozenset({
    "messages", "model", "frequency_penalty", "presence_penalty", "max_tokens", "temperature", "top_p", "stop",
    "stream", "seed", "response_format", "tools", "tool_choice",
})
EXTRA_PARAMETER_MODES = ("error", "ignore", "drop", "pass-through")  # drop: Azure AI inference's word for ignore
_API_VERSION = re.compile(r"^(\d{4})-(\d{2})-(\d{2})(-preview)?$")


class ExtraParametersRejected(UnprocessableContent):
    """`extra-parameters: error` and parameters outside the contract: one 422 naming every one of them."""

    def __init__(self, names: list[str]) -> None:
        listed = ", ".join(f"'{n}'" for n in names)
        super().__init__(
            f"Extra parameters {listed} are not allowed when the extra-parameters header is 'error'. Use "
            "'pass-through' to hand them to the model, or 'ignore' to drop them.",
            param=names[0], code="extra_parameters_not_allowed",
        )
        self.names = names


def check_api_version(value: str | None) -> str:
    """`api-version` must be given as YYYY-MM-DD or YYYY-MM-DD-preview (a real date): else a 400."""
    if value is None:
        raise InvalidParameter("Missing required query parameter: 'api-version' (YYYY-MM-DD or YYYY-MM-DD-preview).",
                               "api-version", "missing_required_parameter")
    m = _API_VERSION.match(value)
    try:
        if m is None:
            raise ValueError
        datetime.date(int(m[1]), int(m[2]), int(m[3]))
    except ValueError:
        raise InvalidParameter(f"Invalid value for 'api-version': {value!r}; expected YYYY-MM-DD or "
                               "YYYY-MM-DD-preview.", "api-version", "invalid_value") from None
    return value


# Azure AI model inference's embeddings: input_type (text, query, document) tells models trained with
# query/document prefixes which to use; the models served here embed every kind alike, so it changes nothing.
AZURE_EMBEDDINGS_PARAMS = frozenset({"input", "model", "dimensions", "encoding_format", "input_type"})
AZURE_INPUT_TYPES = ("text", "query", "document")


def azure_embeddings_body(body: dict[str, Any], mode: str | None) -> tuple[dict[str, Any], list[str]]:
    """An Azure AI model inference embeddings body as our EmbeddingRequest's, and the extras dropped."""
    body, dropped = azure_chat_body(body, mode, AZURE_EMBEDDINGS_PARAMS)
    input_type = body.pop("input_type", None)
    if input_type is not None and input_type not in AZURE_INPUT_TYPES:
        raise InvalidParameter(f"Invalid value for 'input_type': {input_type!r}; expected one of "
                               f"{', '.join(AZURE_INPUT_TYPES)}.", "input_type", "invalid_value")
    return body, dropped


def azure_chat_body(body: dict[str, Any], mode: str | None, params: frozenset[str] = AZURE_CHAT_PARAMS) -> tuple[dict[str, Any], list[str]]:
    """Apply the `extra-parameters` header: the body to validate, and the extra parameters dropped.

    `pass-through`: everything goes to our ChatCompletionRequest (our extensions work; unknown names are
    422s there). `error`: any extra parameter is a 422. `ignore` (`drop`) and no header: extras are dropped (and the
    caller lists them in a response header)."""
    if mode is not None and mode not in EXTRA_PARAMETER_MODES:
        raise InvalidParameter(f"Invalid value for the extra-parameters header: {mode!r}; expected one of "
                               f"{', '.join(EXTRA_PARAMETER_MODES)}.", "extra-parameters", "invalid_value")
    if mode == "pass-through":
        return body, []
    extras = [k for k in body if k not in params]
    if mode == "error" and extras:
        raise ExtraParametersRejected(extras)
    return {k: v for k, v in body.items() if k not in extras}, extras


# -- OpenVINO Model Server ------------------------------------------------------------------------

# Where OVMS's documented defaults differ from OpenAI's: greedy (temperature 0.0) and seed 0. With
# temperature 0, best_of > 1 is beam search of that width (sampling_params' rule, OVMS's too).
OVMS_DEFAULTS: dict[str, Any] = {"temperature": 0.0, "seed": 0}


def ovms_body(body: dict[str, Any]) -> dict[str, Any]:
    """OVMS's defaults filled in where the body leaves a field out (or null)."""
    return {**body, **{k: v for k, v in OVMS_DEFAULTS.items() if body.get(k) is None}}


# -- SageMaker / DJL LMI --------------------------------------------------------------------------

DJL_DEFAULT_MAX_NEW_TOKENS = 30  # DJL LMI's default for the native schema


def invocation_kind(body: dict[str, Any]) -> str:
    """What an /invocations body is: "chat" (messages), "completion" (prompt) or "native" (inputs)."""
    for field, kind in (("messages", "chat"), ("prompt", "completion"), ("inputs", "native")):
        if field in body:
            return kind
    raise InvalidParameter("An /invocations body holds `messages` (chat), `prompt` (completion) or `inputs` "
                           "(DJL's native schema).", None, "missing_required_parameter")


@dataclass(frozen=True)
class PreparedNative(Translated):
    completion: PreparedCompletion
    inputs: list[str]
    batch: bool  # `inputs` was a list: the answer is a list
    details: bool
    full_text: bool

    @property
    def inner(self) -> PreparedCompletion:
        return self.completion


class NativeService:
    """DJL's native schema over CompletionService: `inputs` is the raw prompt (no chat template)."""
    operation = "text_completion"  # its GenAI operation name (traces)


    def __init__(self, completions: CompletionService) -> None:
        self.completions = completions
        self.deployments = completions.deployments

    def prepare(self, req: DjlRequest, ctx: RequestContext = RequestContext()) -> PreparedNative:
        p = req.parameters
        inputs = [req.inputs] if isinstance(req.inputs, str) else list(req.inputs)
        if req.stream and not isinstance(req.inputs, str):
            raise InvalidParameter("A streamed request takes one input (a string).", "inputs", "unsupported_parameter")
        fields: dict[str, Any] = {}
        if p is not None:
            if p.stop is not None and p.stop_sequences is not None:
                raise InvalidParameter("Give `stop` or `stop_sequences`, not both.", "parameters.stop_sequences")
            sample = p.do_sample if p.do_sample is not None else any(
                v is not None for v in (p.temperature, p.top_p, p.top_k, p.min_p))
            if sample:
                fields.update(temperature=1.0 if p.temperature is None else p.temperature,
                              top_p=p.top_p, top_k=p.top_k, min_p=p.min_p)
            fields.update(max_tokens=p.max_new_tokens, seed=p.seed, repetition_penalty=p.repetition_penalty,
                          frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
                          stop=p.stop if p.stop is not None else p.stop_sequences, ignore_eos=p.ignore_eos)
        fields.setdefault("temperature", 0.0)  # DJL: greedy unless do_sample
        if fields.get("max_tokens") is None:
            fields["max_tokens"] = DJL_DEFAULT_MAX_NEW_TOKENS
        details = bool(p and p.details)
        creq = CompletionRequest(model=req.model or default_model(self.deployments), prompt=req.inputs, stream=req.stream,
                                 logprobs=0 if details or req.stream else None,
                                 **{k: v for k, v in fields.items() if v is not None})
        return PreparedNative(self.completions.prepare(creq, ctx), inputs, not isinstance(req.inputs, str), details,
                              bool(p and p.return_full_text))

    async def complete(self, p: PreparedNative) -> DjlOutputs | DjlOutput:
        dep = p.completion.deployment

        async def run(i: int) -> DjlOutput:
            col = Collector(p.completion.jobs[i].generation.params)
            async with aclosing(generate(dep.engine, p.completion.jobs[i].generation, p.screening, i)) as outputs:
                async for out in outputs:
                    col.add(out)
            seq = col.chosen()[0]
            extra = {"details": _details(dep, p.inputs[i], seq)} if p.details else {}
            return DjlOutput(generated_text=_full(p, i, seq.text), **extra)

        outputs = await gather_all([run(i) for i in range(len(p.completion.jobs))])
        return DjlOutputs(outputs) if p.batch else outputs[0]

    async def stream(self, p: PreparedNative) -> AsyncGenerator[DjlStreamLine, None]:
        dep = p.completion.deployment
        seq = SeqResult()
        async with aclosing(generate(dep.engine, p.completion.jobs[0].generation, p.screening)) as outputs:
            async for out in outputs:
                seq.add(out)
                lines = _token_lines(dep, out)
                if out.finished:
                    last = lines.pop() if lines else DjlStreamLine(token=None, generated_text=None, details=None)
                    last.generated_text = _full(p, 0, seq.text)
                    last.details = _details(dep, p.inputs[0], seq) if p.details else None
                    lines.append(last)
                for line in lines:
                    yield line


def _token_lines(dep: TextDeployment, out: GenerationOutput) -> list[DjlStreamLine]:
    """One line per new token; the output's text rides on its last token (so the texts add up)."""
    lines = []
    for k, tid in enumerate(out.token_ids):
        last = k == len(out.token_ids) - 1
        lp = out.logprobs[k].logprob if out.logprobs and k < len(out.logprobs) else 0.0
        token = DjlToken(id=tid, text=out.text if last else "", log_prob=lp)
        lines.append(DjlStreamLine(token=token, generated_text=None, details=None))
    return lines


def _full(p: PreparedNative, i: int, text: str) -> str:
    return p.inputs[i] + text if p.full_text else text


def _details(dep: TextDeployment, inputs: str, seq: SeqResult) -> DjlDetails:
    tokens = [
        DjlToken(id=t, text=dep.vocab.token_bytes(t).decode("utf-8", errors="replace"),
                 log_prob=seq.logprobs[k].logprob if k < len(seq.logprobs) else 0.0)
        for k, t in enumerate(seq.token_ids)
    ]
    return DjlDetails(finish_reason=_djl_finish(seq.final), generated_tokens=len(seq.token_ids), inputs=inputs,
                      tokens=tokens)


def _djl_finish(out: GenerationOutput | None) -> str:
    """DJL's names: "length", "eos_token" (the model ended it) or "stop_sequence" (a `stop` string)."""
    if out is None or out.finish_reason is None:
        return "length"
    if out.finish_reason is FinishReason.STOP:
        return "stop_sequence" if isinstance(out.stop_reason, str) else "eos_token"
    reason: str = out.finish_reason.value
    return reason
