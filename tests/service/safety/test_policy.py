"""A content-filter policy as data: its rules and the annotations that follow them, and its guard's labels, answer
grammar, parsing and default template."""

from __future__ import annotations

import re

import pytest

from servelm.service.safety.blocklist import Blocklist
from servelm.service.safety.policy import LLAMA_GUARD_LABELS, ContentFilter, Finding, Guard, Rule


def test_the_guards_grammar_and_parse():
    guard = Guard("g", labels=LLAMA_GUARD_LABELS)
    for answer in ("safe", "unsafe\nS1", "unsafe\nS14,S2"):
        assert re.fullmatch(guard.answer_regex, answer), answer
    for answer in ("unsafe", "unsafe\nS15", "maybe", "safe\nS1", "unsafe\nS1,"):
        assert not re.fullmatch(guard.answer_regex, answer), answer
    assert guard.parse("safe") == set()
    assert guard.parse("unsafe\nS1,S10") == {"violence", "hate"}
    assert guard.parse("unsafe\nS3,S12,S4") == {"sexual"}
    assert set(guard.categories) >= {"hate", "sexual", "violence", "self_harm", "privacy"}
    with pytest.raises(ValueError):
        Guard("g", labels=())


def test_rules_block_at_a_severity_and_annotations_follow_them():
    policy = ContentFilter(lists=[Blocklist(["x"], "mine")], rules={"violence": Rule("block", "high"),
                                                                  "hate": Rule("annotate"), "privacy": Rule("off")})
    finding = Finding({"violence": "medium", "hate": "high", "privacy": "high", "sexual": "low"}, {"mine": True})
    assert policy.blocked(finding) == ["sexual", "blocklist"]  # sexual: the default rule blocks from low
    results = policy.results(finding)
    assert results["violence"] == {"filtered": False, "severity": "medium"}
    assert results["hate"] == {"filtered": False, "severity": "high"}
    assert "privacy" not in results
    assert results["custom_blocklists"] == {"filtered": True, "details": [{"filtered": True, "id": "mine"}]}
    assert policy.blocked(Finding({"violence": "high"})) == ["violence"]


def test_the_default_template_is_llama_guard_3s_format():
    from servelm.chat.template import ChatTemplate
    from servelm.service.safety.policy import LLAMA_GUARD_TEMPLATE

    text = ChatTemplate(LLAMA_GUARD_TEMPLATE).render(
        [{"role": "user", "content": "How do I bake bread?"}, {"role": "assistant", "content": "Knead it."}],
        role="Agent", categories=[{"label": lab.label, "name": lab.name} for lab in LLAMA_GUARD_LABELS])
    assert text.startswith("<|start_header_id|>user<|end_header_id|>\n\nTask: Check if there is unsafe content in "
                           "'Agent' messages")
    assert "<BEGIN UNSAFE CONTENT CATEGORIES>\nS1: Violent Crimes.\nS2: Non-Violent Crimes.\n" in text
    assert "S14: Code Interpreter Abuse.\n<END UNSAFE CONTENT CATEGORIES>" in text
    assert "<BEGIN CONVERSATION>\n\nUser: How do I bake bread?\n\nAgent: Knead it.\n\n<END CONVERSATION>" in text
    assert text.endswith("categories.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
