"""A guard model: another chat deployment of this server asked whether a conversation is safe. Its prompt is a
Jinja template (Llama Guard 3's format by default) given the conversation, the role to judge and the categories;
its answer is constrained by our grammar to `safe`, or `unsafe` and a line of the template's labels, so that it
always parses. The labels map to categories (Azure's hate, sexual, violence and self_harm, and any other)."""

from __future__ import annotations

import asyncio
import re
import uuid
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

from servelm.chat.template import ChatTemplate
from servelm.constrain.constraint import Constraint
from servelm.engine.types import GenerationRequest, SamplingParams
from servelm.errors import ApiError, ServiceUnavailable
from servelm.service.deployments import Deployments, TextDeployment
from servelm.service.messages import prompt_ids


@dataclass(frozen=True)
class GuardLabel:
    label: str  # what the guard writes (S1)
    name: str  # what the template tells it the label means (Violent Crimes)
    category: str  # what it counts as (violence)


# Llama Guard 3's hazard taxonomy (MLCommons), and the Azure category each one counts as
LLAMA_GUARD_LABELS = tuple(GuardLabel(*row) for row in (
    ("S1", "Violent Crimes", "violence"),
    ("S2", "Non-Violent Crimes", "non_violent_crimes"),
    ("S3", "Sex-Related Crimes", "sexual"),
    ("S4", "Child Sexual Exploitation", "sexual"),
    ("S5", "Defamation", "defamation"),
    ("S6", "Specialized Advice", "specialized_advice"),
    ("S7", "Privacy", "privacy"),
    ("S8", "Intellectual Property", "intellectual_property"),
    ("S9", "Indiscriminate Weapons", "violence"),
    ("S10", "Hate", "hate"),
    ("S11", "Suicide & Self-Harm", "self_harm"),
    ("S12", "Sexual Content", "sexual"),
    ("S13", "Elections", "elections"),
    ("S14", "Code Interpreter Abuse", "code_interpreter_abuse"),
))

# Llama Guard 3's prompt: one user turn holding the task, the categories and the conversation (its turns as
# `User:` and `Agent:`), then the assistant header. The guard model's tokenizer adds the BOS. (Jinja drops a
# template's last newline: the ones the model expects after the header are written as an expression.)
LLAMA_GUARD_TEMPLATE = """<|start_header_id|>user<|end_header_id|>

Task: Check if there is unsafe content in '{{ role }}' messages in conversations according to our safety policy \
with the below categories.

<BEGIN UNSAFE CONTENT CATEGORIES>
{% for c in categories %}
{{ c.label }}: {{ c.name }}.
{% endfor %}
<END UNSAFE CONTENT CATEGORIES>

<BEGIN CONVERSATION>

{% for m in messages %}
{{ 'User' if m.role == 'user' else 'Agent' }}: {{ m.content }}

{% endfor %}
<END CONVERSATION>

Provide your safety assessment for ONLY THE LAST {{ role }} message in the above conversation:
 - First line must read 'safe' or 'unsafe'.
 - If unsafe, a second line must include a comma-separated list of violated categories.\
<|eot_id|><|start_header_id|>assistant<|end_header_id|>{{ "\\n\\n" }}
"""


class GuardUnavailable(ServiceUnavailable):
    """The guard could not answer (down, busy past its timeout, or it failed): the policy fails closed with
    this 503, or open."""

    def __init__(self, deployment: str, why: str) -> None:
        super().__init__(f"The content filter's guard model `{deployment}` could not check this request: {why}.",
                         code="content_filter_unavailable")


class Guard:
    """One policy's guard: the deployment that judges, its template, its labels, and how long it may take."""

    def __init__(self, deployment: str, template: str = LLAMA_GUARD_TEMPLATE,
                 labels: tuple[GuardLabel, ...] = LLAMA_GUARD_LABELS, timeout: float = 10.0,
                 max_tokens: int = 64) -> None:
        if not labels:
            raise ValueError("a guard needs at least one label")
        self.deployment = deployment
        self.source = template
        self.labels = labels
        self.timeout = timeout
        self.max_tokens = max_tokens
        self._by_label = {lab.label: lab.category for lab in labels}
        names = "|".join(re.escape(lab.label) for lab in sorted(labels, key=lambda lab: -len(lab.label)))
        self.answer_regex = f"safe|unsafe\\n({names})(,({names}))*"
        # the guard deployment by name → (it, it with our template, the answer's grammar)
        self._views: dict[str, tuple[TextDeployment, TextDeployment, Constraint]] = {}

    @property
    def categories(self) -> list[str]:
        """The categories it can flag, in the order its labels name them."""
        return list(dict.fromkeys(lab.category for lab in self.labels))

    def check(self, deployments: Deployments) -> None:
        """At start-up: the guard deployment generates text under a grammar, and the template renders."""
        dep = deployments.generator(self.deployment)
        if dep.grammars is None:
            raise ValueError(f"the guard deployment {self.deployment!r} cannot constrain its answer (no grammars: "
                             "a vLLM deployment); use a llama.cpp one")
        self._view(dep)

    def _view(self, dep: TextDeployment) -> tuple[TextDeployment, Constraint]:
        """The guard deployment with our template in place of its chat template, and the answer's grammar."""
        cached = self._views.get(dep.name)
        if cached is None or cached[0] is not dep:
            if dep.grammars is None:
                raise GuardUnavailable(self.deployment, "it cannot constrain its answer")
            template = ChatTemplate(self.source, bos_token=dep.template.bos_token, eos_token=dep.template.eos_token)
            cached = self._views[dep.name] = (dep, replace(dep, template=template), dep.grammars.regex(self.answer_regex))
        return cached[1], cached[2]

    async def judge(self, deployments: Deployments, messages: list[dict[str, Any]], role: str, scope: str) -> set[str]:
        """The categories the guard flags in the conversation's last `role` turn ("User" or "Agent")."""
        try:
            dep = deployments.generator(self.deployment)
        except ApiError:
            raise GuardUnavailable(self.deployment, "it is not deployed") from None
        if not dep.engine.alive:
            raise GuardUnavailable(self.deployment, "it is down")
        view, grammar = self._view(dep)
        ids = self._prompt(view, messages, role)
        request = GenerationRequest(f"guard-{uuid.uuid4().hex}", tuple(ids),
                                    SamplingParams(max_tokens=self.max_tokens, temperature=0.0), grammar,
                                    cache_scope=scope)
        try:
            text = await asyncio.wait_for(_answer(dep, request), self.timeout)
        except TimeoutError:
            raise GuardUnavailable(self.deployment, f"it did not answer within {self.timeout:g} s") from None
        except ApiError as exc:
            raise GuardUnavailable(self.deployment, exc.message) from None
        return self.parse(text)

    def _prompt(self, view: TextDeployment, messages: list[dict[str, Any]], role: str) -> list[int]:
        """The guard's prompt; a conversation too long for its context loses its earliest turns, then the start
        of the last one."""
        extra = {"role": role, "categories": [{"label": lab.label, "name": lab.name} for lab in self.labels]}
        room = view.context_window - self.max_tokens
        while True:
            ids, _, _ = prompt_ids(view, messages, extra)
            if len(ids) <= room:
                return ids
            if len(messages) > 1:
                messages = messages[1:]
            else:
                text = messages[0]["content"]
                messages = [{**messages[0], "content": text[len(text) // 2:]}]

    def parse(self, text: str) -> set[str]:
        """The flagged categories of an answer the grammar allowed (`safe`, or `unsafe` and labels)."""
        lines = text.strip().split("\n")
        if lines[0].strip() != "unsafe" or len(lines) < 2:
            return set()
        return {self._by_label[lab.strip()] for lab in lines[1].split(",") if lab.strip() in self._by_label}


async def _answer(dep: TextDeployment, request: GenerationRequest) -> str:
    text = ""
    async with aclosing(dep.engine.generate(request)) as outputs:
        async for out in outputs:
            text += out.text
    return text
