"""Content filtering: a deployment's policy (service/safety/blocklist.py's lists, service/safety/guard.py's guard model, an
action per category), and each request's Screening of it.

- The prompt is checked before anything runs: a flagged one is a 400 `content_filter` naming the message
  (`messages[2].content`), no generation started.
- The answer is checked as it is made, a window of `window` tokens at a time, the text so far as a whole (a term
  split across two windows is caught in the second): a window is released to the client only once checked, so a
  stream runs at most `window` tokens and one check behind the engine. A flagged window is withheld; the choice
  ends with finish_reason `content_filter` (and the policy's `blocked_message`), and its request is aborted, its
  KV cells freed at the engine's next step.
- With a policy, answers carry Azure OpenAI's annotations: `prompt_filter_results` and each choice's
  `content_filter_results` (per category `filtered` and `severity`; the lists under `custom_blocklists`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from servelm.engine.base import Engine
from servelm.engine.types import FinishReason, GenerationOutput, GenerationRequest
from servelm.errors import ContentFiltered
from servelm.service.registry.deployments import Deployments, TextDeployment
from servelm.service.safety import guard as guards
from servelm.service.safety.guard import GuardUnavailable
from servelm.service.safety.policy import GUARD_SEVERITY
from servelm.service.safety.policy import ContentFilter as ContentFilter
from servelm.service.safety.policy import Finding as Finding
from servelm.service.safety.policy import Rule as Rule

# (deployment, direction "input" or "output", the categories that blocked): for /metrics and the access log
FilterEvents = Callable[[str, str, Sequence[str]], None]


@dataclass(frozen=True)
class PromptText:
    """A piece of a prompt the input check reads: where it is in the request, whose it is, and its text."""

    param: str  # messages[2].content, prompt[1], ...
    role: str  # user, assistant, system, tool
    text: str


def check_guard(policy: ContentFilter, deployments: Deployments) -> None:
    """At start-up: a guard names a deployment that can judge."""
    if policy.guard is not None:
        guards.check(policy.guard, deployments)


async def judge(policy: ContentFilter, deployments: Deployments, finding: Finding, conversation: list[dict[str, Any]], role: str,
                scope: str) -> None:
    """The guard's verdict on the conversation's last `role` turn, into the finding (its error, failing open)."""
    guard = policy.guard
    if guard is None or not conversation:
        return
    try:
        flagged = await guards.judge(guard, deployments, conversation, role, scope)
    except GuardUnavailable as exc:
        if not policy.fail_open:
            raise
        finding.error = exc.message
        return
    for category in guard.categories:
        finding.severities[category] = GUARD_SEVERITY if category in flagged else "safe"


@dataclass
class _Choice:
    """One choice's output under check: what was released, what waits for its window's check."""

    text: str = ""  # released
    held: list[GenerationOutput] = field(default_factory=list)
    tokens: int = 0  # held tokens
    over: bool = False  # finished, or blocked
    results: dict[str, Any] | None = None  # of the check that released its latest outputs


class Screening:
    """One request under a deployment's policy: its prompts' check, and its answers' windows."""

    def __init__(self, policy: ContentFilter, deployments: Deployments, deployment: str,
                 prompts: Sequence[Sequence[PromptText]], scope: str = "", events: FilterEvents | None = None) -> None:
        self.policy = policy
        self._deployments = deployments
        self._deployment = deployment
        self._prompts = [list(p) for p in prompts]
        self._scope = scope + ":guard"  # the guard's prompts are cached per caller, apart from the caller's own
        self._events = events
        self.prompt_results: list[dict[str, Any]] = []
        self._choices: dict[tuple[int, int], _Choice] = {}

    @classmethod
    def of(cls, dep: TextDeployment, deployments: Deployments, prompts: Sequence[Sequence[PromptText]], scope: str,
           events: FilterEvents | None) -> Screening | None:
        """The request's screening under its deployment's policy; None when the deployment has none."""
        if dep.content_filter is None:
            return None
        return cls(dep.content_filter, deployments, dep.name, prompts, scope, events)

    # -- the prompt --------------------------------------------------------------------------------
    async def check_prompt(self) -> None:
        """Raise ContentFiltered for a prompt the policy blocks; else note each prompt's results."""
        if not self.policy.input:
            return
        checked = await asyncio.gather(*(self._check_prompt(texts) for texts in self._prompts))
        for i, (finding, param) in enumerate(checked):
            blocked = self.policy.blocked(finding)
            results = self.policy.results(finding)
            if blocked:
                self._note("input", blocked)
                raise ContentFiltered(param, blocked, results)
            self.prompt_results.append({"prompt_index": i, "content_filter_results": results})

    async def _check_prompt(self, texts: list[PromptText]) -> tuple[Finding, str]:
        """The finding on one prompt, and the param to name if it blocks: the first text a list hits, else the
        last user turn (the one a guard judges)."""
        finding = Finding()
        hit = None
        for t in texts:
            for name, found in self.policy.search_lists(t.text).items():
                finding.lists[name] = finding.lists.get(name, False) or found
                if found and hit is None:
                    hit = t.param
        if hit is not None and self.policy.blocked(finding):
            return finding, hit
        turns = [t for t in texts if t.role in ("user", "assistant")]
        while turns and turns[-1].role != "user":
            turns.pop()
        conversation = [{"role": t.role, "content": t.text} for t in turns]
        await judge(self.policy, self._deployments, finding, conversation, "User", self._scope)
        return finding, hit or (turns[-1].param if turns else texts[-1].param if texts else "messages")

    # -- the answer --------------------------------------------------------------------------------
    def results(self, index: int, prompt: int = 0) -> dict[str, Any] | None:
        """The content_filter_results of a choice's latest released outputs (None: nothing checked yet)."""
        choice = self._choices.get((prompt, index))
        return choice.results if choice is not None else None

    async def outputs(self, outputs: AsyncGenerator[GenerationOutput, None], seqs: int,
                      prompt: int = 0) -> AsyncGenerator[GenerationOutput, None]:
        """The engine's outputs for one prompt, each choice's released a checked window at a time; a blocked
        choice ends with finish_reason content_filter. Once every choice is over, the engine's request is closed
        (aborting what still runs: a blocked single choice frees its cells at once)."""
        choices: dict[int, _Choice] = {}
        async with aclosing(outputs) as it:
            async for out in it:
                c = choices.get(out.index)
                if c is None:
                    c = choices[out.index] = self._choices[(prompt, out.index)] = _Choice()
                if c.over:
                    continue  # a blocked choice of several: its sequence runs on unseen until the request ends
                c.held.append(out)
                c.tokens += len(out.token_ids)
                if c.tokens < self.policy.window and not out.finished:
                    continue
                text = c.text + "".join(o.text for o in c.held)
                finding = await self._check_answer(prompt, text)
                c.results = self.policy.results(finding)
                blocked = self.policy.blocked(finding)
                if blocked:
                    self._note("output", blocked)
                    c.over = True
                    yield _blocked(out, self.policy.blocked_message)
                else:
                    c.over = out.finished
                    for o in c.held:
                        yield o
                    c.text = text
                c.held, c.tokens = [], 0
                if len(choices) == seqs and all(ch.over for ch in choices.values()):
                    return

    async def _check_answer(self, prompt: int, text: str) -> Finding:
        finding = Finding(lists=self.policy.search_lists(text))
        if not self.policy.blocked(finding):
            turns = [{"role": t.role, "content": t.text} for t in self._prompts[prompt] if t.role in ("user", "assistant")]
            await judge(self.policy, self._deployments, finding, [*turns, {"role": "assistant", "content": text}],
                                    "Agent", self._scope)
        return finding

    def _note(self, direction: str, categories: Sequence[str]) -> None:
        if self._events is not None:
            self._events(self._deployment, direction, categories)


def choice_results(screening: Screening | None, index: int, prompt: int = 0) -> dict[str, Any]:
    """A choice's `content_filter_results` as a response field (Azure OpenAI's annotation), when its deployment
    has a policy and the choice has been checked: {} otherwise."""
    results = screening.results(index, prompt) if screening is not None else None
    return {"content_filter_results": results} if results is not None else {}


def generate(engine: Engine, request: GenerationRequest, screening: Screening | None,
             prompt: int = 0) -> AsyncGenerator[GenerationOutput, None]:
    """A request's outputs from its deployment's engine, through its screening when its deployment has a policy."""
    outputs = engine.generate(request)
    if screening is None or not screening.policy.output:
        return outputs
    params = request.params
    return screening.outputs(outputs, params.n if params.beam is not None else params.num_seqs, prompt)


def _blocked(out: GenerationOutput, message: str) -> GenerationOutput:
    """The last output of a blocked choice: the withheld window's place taken by the policy's message; its tokens
    still counted (they were generated)."""
    return GenerationOutput(out.request_id, out.index, message, finish_reason=FinishReason.CONTENT_FILTER,
                            prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                            cached_tokens=out.cached_tokens, cumulative_logprob=out.cumulative_logprob,
                            reasoning_tokens=out.reasoning_tokens, queued_seconds=out.queued_seconds,
                            prompt_seconds=out.prompt_seconds)
