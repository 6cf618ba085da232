"""The content filter's config without a server: the tables and the flag that make a deployment's policy (the
lists are tests/service/test_blocklist.py's, the policy's rules and guard labels test_policy.py's)."""

from __future__ import annotations

import pytest

from servelm.compose import content_filter_of, with_blocklist
from servelm.config import ConfigFile, ContentFilterSpec, DeploymentSpec
from servelm.service.safety.content_filter import Rule
from servelm.service.safety.guard import GuardLabel


def test_a_policy_from_config(tmp_path):
    words = tmp_path / "words.txt"
    words.write_text("alpha\nre:be+ta\n")
    template = tmp_path / "guard.jinja"
    template.write_text("{{ messages[-1].content }}")
    config = ConfigFile.model_validate({"deployments": [
        {"name": "chat", "model": "m.gguf", "content_filter": {
            "blocklist": [str(words)], "terms": ["gamma"], "window": 8, "on_guard_error": "open",
            "categories": {"hate": "annotate", "violence": {"action": "block", "severity": "high"}},
            "guard": {"deployment": "guard", "template": str(template),
                      "labels": [{"label": "A", "name": "Animals", "category": "violence"}], "timeout": 2}}},
        {"name": "guard", "model": "g.gguf"}]})
    policy = content_filter_of(config.deployments[0].content_filter)
    assert policy is not None and policy.window == 8 and policy.fail_open
    assert [lst.name for lst in policy.lists] == ["words", "terms"]
    assert policy.rule("hate") == Rule("annotate") and policy.rule("violence") == Rule("block", "high")
    assert policy.guard is not None and policy.guard.labels == (GuardLabel("A", "Animals", "violence"),)
    assert policy.guard.source == "{{ messages[-1].content }}" and policy.guard.timeout == 2
    with pytest.raises(ValueError, match="not a chat deployment"):
        ConfigFile.model_validate({"deployments": [
            {"name": "chat", "model": "m.gguf", "content_filter": {"guard": {"deployment": "nobody"}}}]})
    with pytest.raises(ValueError, match="needs a blocklist, terms or a guard"):
        ContentFilterSpec()


def test_the_blocklist_flag_reaches_every_chat_deployment(tmp_path):
    words = tmp_path / "w.txt"
    specs = [DeploymentSpec(name="a", model="a.gguf"),
             DeploymentSpec(name="b", model="b.gguf", content_filter=ContentFilterSpec(terms=["x"], output=False)),
             DeploymentSpec(name="e", model="e.gguf", kind="embedding")]
    out = with_blocklist(specs, words)
    assert out[0].content_filter == ContentFilterSpec(blocklist=[words])
    assert out[1].content_filter is not None and out[1].content_filter.blocklist == [words]
    assert out[1].content_filter.output is False and out[1].content_filter.terms == ["x"]
    assert out[2].content_filter is None
    assert with_blocklist(specs, None) is specs
