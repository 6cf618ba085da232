"""A guard model: another chat deployment of this server asked whether a conversation is safe. Its prompt is a
Jinja template (Llama Guard 3's format by default) given the conversation, the role to judge and the categories;
its answer is constrained by our grammar to `safe`, or `unsafe` and a line of the template's labels, so that it
always parses. The labels map to categories (Azure's hate, sexual, violence and self_harm, and any other)."""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from servelm import tracing
from servelm.chat.template import ChatTemplate
from servelm.constrain.constraint import Constraint
from servelm.engine.types import GenerationRequest, SamplingParams
from servelm.errors import ApiError, ServiceUnavailable
from servelm.service.messages import prompt_ids
from servelm.service.registry.deployments import Deployments, TextDeployment
from servelm.service.safety.policy import LLAMA_GUARD_LABELS as LLAMA_GUARD_LABELS
from servelm.service.safety.policy import LLAMA_GUARD_TEMPLATE as LLAMA_GUARD_TEMPLATE
from servelm.service.safety.policy import Guard as Guard
from servelm.service.safety.policy import GuardLabel as GuardLabel

# each guard's deployment by name → (it, it with the guard's template, the answer's grammar)
_views: weakref.WeakKeyDictionary[Guard, dict[str, tuple[TextDeployment, TextDeployment, Constraint]]] = \
    weakref.WeakKeyDictionary()


class GuardUnavailable(ServiceUnavailable):
    """The guard could not answer (down, busy past its timeout, or it failed): the policy fails closed with
    this 503, or open."""

    def __init__(self, deployment: str, why: str) -> None:
        super().__init__(f"The content filter's guard model `{deployment}` could not check this request: {why}.",
                         code="content_filter_unavailable")


def check(guard: Guard, deployments: Deployments) -> None:
    """At start-up: the guard deployment generates text under a grammar, and the template renders."""
    dep = deployments.generator(guard.deployment)
    if dep.grammars is None:
        raise ValueError(f"the guard deployment {guard.deployment!r} cannot constrain its answer (no grammars: "
                         "a vLLM deployment); use a llama.cpp one")
    _view(guard, dep)

def _view(guard: Guard, dep: TextDeployment) -> tuple[TextDeployment, Constraint]:
    """The guard deployment with our template in place of its chat template, and the answer's grammar."""
    views = _views.setdefault(guard, {})
    cached = views.get(dep.name)
    if cached is None or cached[0] is not dep:
        if dep.grammars is None:
            raise GuardUnavailable(guard.deployment, "it cannot constrain its answer")
        template = ChatTemplate(guard.source, bos_token=dep.template.bos_token, eos_token=dep.template.eos_token)
        cached = views[dep.name] = (dep, replace(dep, template=template), dep.grammars.regex(guard.answer_regex))
    return cached[1], cached[2]

async def judge(guard: Guard, deployments: Deployments, messages: list[dict[str, Any]], role: str, scope: str) -> set[str]:
    """The categories the guard flags in the conversation's last `role` turn ("User" or "Agent")."""
    try:
        dep = deployments.generator(guard.deployment)
    except ApiError:
        raise GuardUnavailable(guard.deployment, "it is not deployed") from None
    if not dep.engine.alive:
        raise GuardUnavailable(guard.deployment, "it is down")
    view, grammar = _view(guard, dep)
    ids = _prompt(guard, view, messages, role)
    request = GenerationRequest(f"guard-{uuid.uuid4().hex}", tuple(ids),
                                SamplingParams(max_tokens=guard.max_tokens, temperature=0.0), grammar,
                                cache_scope=scope)
    start = time.monotonic()
    try:
        text = await asyncio.wait_for(_answer(dep, request), guard.timeout)
    except TimeoutError:
        raise GuardUnavailable(guard.deployment, f"it did not answer within {guard.timeout:g} s") from None
    except ApiError as exc:
        raise GuardUnavailable(guard.deployment, exc.message) from None
    flagged = guard.parse(text)
    tracing.event("servelm.guard_check", servelm__guard=guard.deployment, servelm__role=role,
                  servelm__flagged=sorted(flagged), servelm__seconds=time.monotonic() - start)
    return flagged

def _prompt(guard: Guard, view: TextDeployment, messages: list[dict[str, Any]], role: str) -> list[int]:
    """The guard's prompt; a conversation too long for its context loses its earliest turns, then the start
    of the last one."""
    extra = {"role": role, "categories": [{"label": lab.label, "name": lab.name} for lab in guard.labels]}
    room = view.context_window - guard.max_tokens
    while True:
        ids, _, _ = prompt_ids(view, messages, extra)
        if len(ids) <= room:
            return ids
        if len(messages) > 1:
            messages = messages[1:]
        else:
            text = messages[0]["content"]
            messages = [{**messages[0], "content": text[len(text) // 2:]}]


async def _answer(dep: TextDeployment, request: GenerationRequest) -> str:
    text = ""
    async with aclosing(dep.engine.generate(request)) as outputs:
        async for out in outputs:
            text += out.text
    return text
