"""A deployment's content-filter policy as data: what is checked (input, output), by what (service/safety/blocklist.py's
lists, a guard model), what each category's finding does, and how an answer that is blocked ends. The checks
themselves run in service/safety/content_filter.py (a request's Screening) and service/safety/guard.py (asking the guard
deployment); a deployment holds its policy (service/registry/deployments.py)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from servelm.service.safety.blocklist import Blocklist

SEVERITIES = ("safe", "low", "medium", "high")
LISTS = "blocklist"  # the category a list's hit counts as (its rule; annotated as custom_blocklists)
GUARD_SEVERITY = "high"  # a guard's flag: its labels have no degrees

@dataclass(frozen=True)
class Rule:
    """What a category's finding does: `block` at `severity` or above (annotated below it), `annotate` only, or
    `off` (neither checked into the answer nor reported)."""

    action: str = "block"
    severity: str = "low"

    def blocks(self, severity: str) -> bool:
        return self.action == "block" and severity != "safe" and SEVERITIES.index(severity) >= SEVERITIES.index(self.severity)


@dataclass
class Finding:
    """One check: each category's severity, each list's hit, and the guard's error when the policy failed open."""

    severities: dict[str, str] = field(default_factory=dict)
    lists: dict[str, bool] = field(default_factory=dict)
    error: str | None = None


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

    @property
    def categories(self) -> list[str]:
        """The categories it can flag, in the order its labels name them."""
        return list(dict.fromkeys(lab.category for lab in self.labels))

    def parse(self, text: str) -> set[str]:
        """The flagged categories of an answer the grammar allowed (`safe`, or `unsafe` and labels)."""
        lines = text.strip().split("\n")
        if lines[0].strip() != "unsafe" or len(lines) < 2:
            return set()
        return {self._by_label[lab.strip()] for lab in lines[1].split(",") if lab.strip() in self._by_label}


class ContentFilter:
    """A deployment's policy: what is checked (input, output), by what (lists, a guard), what each category's
    finding does, and how an answer that is blocked ends."""

    def __init__(self, *, input: bool = True, output: bool = True, window: int = 32, lists: Sequence[Blocklist] = (),
                 guard: Guard | None = None, rules: dict[str, Rule] | None = None, fail_open: bool = False,
                 blocked_message: str = "") -> None:
        if window < 1:
            raise ValueError("a content filter's window is at least one token")
        self.input, self.output, self.window = input, output, window
        self.lists, self.guard = tuple(lists), guard
        self.rules = dict(rules or {})
        self.fail_open = fail_open
        self.blocked_message = blocked_message

    def rule(self, category: str) -> Rule:
        return self.rules.get(category, Rule())

    def blocked(self, f: Finding) -> list[str]:
        """The categories that block, in the finding's order (the lists as `blocklist`)."""
        out = [c for c, sev in f.severities.items() if self.rule(c).blocks(sev)]
        if any(f.lists.values()) and self.rule(LISTS).blocks(GUARD_SEVERITY):
            out.append(LISTS)
        return out

    def results(self, f: Finding) -> dict[str, Any]:
        """Azure OpenAI's content_filter_results for a finding: the categories checked, the lists, an error."""
        out: dict[str, Any] = {}
        for category, severity in f.severities.items():
            rule = self.rule(category)
            if rule.action != "off":
                out[category] = {"filtered": rule.blocks(severity), "severity": severity}
        if f.lists and self.rule(LISTS).action != "off":
            block = self.rule(LISTS).blocks(GUARD_SEVERITY)
            details = [{"filtered": hit and block, "id": name} for name, hit in f.lists.items()]
            out["custom_blocklists"] = {"filtered": any(d["filtered"] for d in details), "details": details}
        if f.error is not None:
            out["error"] = {"code": "content_filter_unavailable", "message": f.error}
        return out

    def search_lists(self, text: str) -> dict[str, bool]:
        return {lst.name: lst.search(text) for lst in self.lists} if self.rule(LISTS).action != "off" else {}
