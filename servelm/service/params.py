"""The request fields every generating endpoint shares → SamplingParams, with every check that can be a 400.

Chat and legacy completions both parse into GenerationFields; each endpoint says how many logprobs it
wants, the name of its prompt parameter, and its own max_tokens field, and the rest is checked here once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from servelm.engine.types import BeamParams, SamplingParams, Tenant
from servelm.errors import ContextLengthExceeded, InvalidParameter
from servelm.protocol.common import GenerationFields, SamplingExtras
from servelm.service.registry.deployments import Deployment, TextDeployment
from servelm.service.safety.content_filter import FilterEvents


@dataclass(frozen=True)
class RequestContext:
    """What the HTTP layer knows of a request that the services need: who sent it."""

    owner: str = ""  # the API key's digest (hex); "" on an open server
    max_batch_prompts: int = 128  # prompts one legacy-completions request may carry
    timings: bool = False  # every answer carries llama-server's timings (the server's --timings)
    on_filtered: FilterEvents | None = None  # a content filter blocked it: for /metrics and the access log
    min_priority: int | None = None  # the most urgent priority its key may ask for (KeySpec.priority_floor); None: any
    tenant: Tenant = Tenant()  # who its generations count against for the engine's fair share of slots


def cache_scope(owner: str, salt: str | None) -> str:
    """The prefix-cache scope of a request: its key, subdivided by its cache_salt. Requests of one key (and one
    salt) share cached prompts; no key reads another's. An open server without salts has one scope, ""."""
    if not owner and salt is None:
        return ""
    return hashlib.sha256(f"{owner}\x00{salt or ''}".encode()).hexdigest()[:32]


def cache_hint(scope: str, prompt_cache_key: str | None) -> str:
    """A prompt_cache_key as a routing hint that only requests of the same scope share."""
    return f"{scope}\x00{prompt_cache_key}" if prompt_cache_key else ""


@dataclass(frozen=True)
class EndpointParams:
    """What differs between endpoints for the same request fields."""

    max_tokens: int | None  # the endpoint's max_tokens (chat's max_completion_tokens wins over max_tokens)
    max_tokens_param: str = "max_tokens"
    prompt_param: str = "messages"  # named in context-length errors
    logprobs: int | None = None  # top alternatives per token; None for no logprobs
    prompt_logprobs: int | None = None
    skip_special_default: bool = True
    constrained: bool = False  # the output is bound by a grammar (beam search cannot follow one yet)


def request_priority(req: SamplingExtras, dep: Deployment, ctx: RequestContext) -> int:
    """The request's priority (vLLM's: lower runs first), within what the deployment lets a request ask for and what
    its key may ask for (without a grant of its own, nothing below 0)."""
    priority = req.priority or 0
    if dep.min_priority is not None and priority < dep.min_priority:
        raise InvalidParameter(f"priority must be at least {dep.min_priority} on this deployment (lower is more "
                               f"urgent); got {priority}.", "priority")
    if ctx.min_priority is not None and priority < ctx.min_priority:
        raise InvalidParameter(f"priority must be at least {ctx.min_priority} for this API key (lower is more urgent; "
                               f"a key's min_priority grants more); got {priority}.", "priority")
    return priority


def request_adapters(req: SamplingExtras, dep: TextDeployment) -> tuple[tuple[str, float], ...]:
    """The LoRA adapters a request runs with: the one its `model` names, and llama-server's `lora` list."""
    if dep.adapters is None:
        if req.lora:
            raise InvalidParameter(f"The model `{dep.name}` takes no LoRA adapters.", "lora")
        return ()
    return dep.adapters.select(req.model, req.lora)


def sampling_params(req: GenerationFields, dep: TextDeployment, prompt_len: int, ep: EndpointParams) -> SamplingParams:
    n = req.n or 1
    best_of = req.best_of
    if best_of is not None and best_of < n:
        raise InvalidParameter(f"best_of ({best_of}) must be at least n ({n}).", "best_of")
    seqs = best_of or n
    if seqs > dep.max_choices:
        param = "best_of" if best_of else "n"
        raise InvalidParameter(f"{param} must be at most {dep.max_choices} on this deployment; got {seqs}.", param)
    beam = _beam(req, seqs, ep)
    if ep.logprobs is not None and ep.logprobs > 20:
        raise InvalidParameter(f"at most 20 logprobs per token may be asked for; got {ep.logprobs}.", "logprobs")
    max_tokens = _max_tokens(ep, dep.context_window, prompt_len)
    if req.min_tokens is not None and req.min_tokens > max_tokens:
        raise InvalidParameter(f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens}).", "min_tokens")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if any(s == "" for s in stop):
        raise InvalidParameter("stop strings must not be empty.", "stop")
    stop += tuple(s for s in dep.template_stops if s not in stop)
    for t in req.stop_token_ids or ():
        if t >= dep.vocab.size:
            raise InvalidParameter(f"stop_token_ids has {t}, outside the vocabulary (0..{dep.vocab.size - 1}).", "stop_token_ids")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k in (None, -1) else req.top_k,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=logit_bias(req.logit_bias, dep.vocab.size),
        stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=bool(req.ignore_eos),
        min_tokens=req.min_tokens or 0,
        n=n,
        best_of=best_of if best_of is not None and best_of != n else None,
        skip_special_tokens=ep.skip_special_default if req.skip_special_tokens is None else req.skip_special_tokens,
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        logprobs=ep.logprobs,
        prompt_logprobs=_prompt_logprobs(req, ep),
        beam=beam,
    )
    dep.engine.check_params(params)  # what this deployment's engine cannot do (a vLLM one: beam search)
    return params


def _prompt_logprobs(req: GenerationFields, ep: EndpointParams) -> int | None:
    """Alternatives per prompt token: the endpoint's (echo with logprobs) and vLLM's prompt_logprobs, the more."""
    if req.prompt_logprobs is not None and req.stream:
        raise InvalidParameter("prompt_logprobs is not available when stream is true.", "prompt_logprobs")
    asked = [k for k in (ep.prompt_logprobs, req.prompt_logprobs) if k is not None]
    return max(asked) if asked else None


def _beam(req: GenerationFields, width: int, ep: EndpointParams) -> BeamParams | None:
    """Beam search when asked for (use_beam_search), or when best_of > 1 at temperature 0 (OVMS's rule:
    greedy samples would all be the same text). Beam-only settings without beam search are a 400."""
    on = req.use_beam_search if req.use_beam_search is not None else ((req.best_of or 1) > 1 and req.temperature == 0.0)
    beam_only = {"length_penalty": req.length_penalty, "diversity_penalty": req.diversity_penalty,
                 "num_beam_groups": req.num_beam_groups, "early_stopping": req.early_stopping}
    if not on:
        for name, value in beam_only.items():
            if value is not None and value not in (1.0, 0.0, 1, False):  # the neutral values are harmless
                raise InvalidParameter(f"{name} applies to beam search only; set use_beam_search or best_of > 1 "
                                       "with temperature 0.", name)
        return None
    if ep.constrained:
        raise InvalidParameter("beam search cannot be combined with response_format, structured outputs or tools.",
                               "use_beam_search" if req.use_beam_search else "best_of", "unsupported_parameter")
    for name in ("top_p", "top_k", "min_p"):
        value = getattr(req, name)
        if value is not None and value not in (1.0, -1, 0, 0.0):
            raise InvalidParameter(f"{name} does not apply to beam search, which keeps the most likely beams.", name)
    diversity = req.diversity_penalty or 0.0
    groups = req.num_beam_groups or (width if diversity > 0 else 1)
    if width % groups:
        raise InvalidParameter(f"num_beam_groups ({groups}) must divide the beam width best_of ({width}).", "num_beam_groups")
    if diversity > 0 and groups == 1:
        raise InvalidParameter("diversity_penalty needs num_beam_groups > 1 (beams in one group are not compared).",
                               "diversity_penalty")
    return BeamParams(
        length_penalty=1.0 if req.length_penalty is None else req.length_penalty,
        diversity_penalty=diversity,
        groups=groups,
        early_stopping=bool(req.early_stopping),
    )


def _max_tokens(ep: EndpointParams, window: int, prompt_len: int) -> int:
    max_tokens = ep.max_tokens
    if max_tokens is None:
        if prompt_len >= window:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {window} tokens. However, your {ep.prompt_param} resulted "
                f"in {prompt_len} tokens. Please reduce the length of the {ep.prompt_param}.", ep.prompt_param
            )
        return window - prompt_len
    if prompt_len + max_tokens > window:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {window} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the {ep.prompt_param}, {max_tokens} in the completion "
            f"({ep.max_tokens_param})). Please reduce the length of the {ep.prompt_param} or completion.",
            ep.prompt_param,
        )
    return max_tokens


def logit_bias(bias: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    out = []
    for key, value in (bias or {}).items():
        # a token id in plain ASCII decimal: int() also takes " 5", "+5", "05", "5_0" (50) and other scripts' digits
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and (key == "0" or key[0] != "0")):
            raise InvalidParameter(f"logit_bias keys must be token ids (decimal, no sign, spaces or leading zeros); "
                                   f"got {key[:40]!r}.", "logit_bias")
        token = int(key)
        if not 0 <= token < vocab:
            raise InvalidParameter(f"logit_bias has token id {token}, outside the vocabulary (0..{vocab - 1}).", "logit_bias")
        out.append((token, float(value)))
    return tuple(out)
