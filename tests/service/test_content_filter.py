"""The content filter's parts without a server: lists and their normalization, the guard's answer grammar and
parsing, a policy's rules and annotations, and the config tables and flag that make a policy."""

from __future__ import annotations

import re

import pytest

from servelm.compose import content_filter_of, with_blocklist
from servelm.config import ConfigFile, ContentFilterSpec, DeploymentSpec
from servelm.service.blocklist import Blocklist, BlocklistError, normalize
from servelm.service.content_filter import ContentFilter, Finding, Rule
from servelm.service.guard import LLAMA_GUARD_LABELS, Guard, GuardLabel


@pytest.mark.parametrize("text", ["BAD", "ＢＡＤ", "bàd", "b\u200bad", "b\u00adad", "bаd", "b4d", "a bad day", "bad!"])
def test_look_alike_spellings_of_a_term_are_caught(text):
    assert Blocklist(["bad"]).search(text), text


@pytest.mark.parametrize("text", ["xforbiddenword", "forbiddenwords", "_forbiddenword_", "ꜰᴏʀʙɪᴅᴅᴇɴᴡᴏʀᴅ",
                                  "forbıddenword", "aaaaaaaaaaforbiddenword done", "FORBIDDEN_WORD".replace("_", "")])
def test_a_term_is_found_glued_to_letters_and_in_look_alike_letters(text):
    """Issue 32's bypass corpus: glued spellings, small capitals and a dotless i all passed."""
    assert Blocklist(["forbiddenword"]).search(text), text


def test_a_term_glued_to_itself_is_found():
    assert Blocklist(["Hello"]).search("HelloHelloHello")


@pytest.mark.parametrize("text", ["badge", "abad", "xbadx"])
def test_whole_word_terms_and_lists_match_whole_words_only(text):
    assert not Blocklist(["word:bad"]).search(text) and not Blocklist(["bad"], whole_words=True).search(text)
    assert Blocklist(["bad"]).search(text), "the default finds it glued"
    assert Blocklist(["word:bad"]).search("a bad day") and Blocklist(["bad"], whole_words=True).search("bad!")


@pytest.mark.parametrize("text", ["ba d", "good"])
def test_a_term_is_not_found_where_it_is_not(text):
    assert not Blocklist(["bad"]).search(text)


def test_phrases_regexes_and_comments():
    lst = Blocklist(["# a comment", "", "very  bad thing", r"re:\b\d{3}-\d{4}\b", "re:kill(ed|ing)?\\s+\\w+"])
    assert lst.size == 3
    assert lst.search("a VERY bad\tthing indeed")
    assert lst.search("call 555-1234 now") and not lst.search("call 5551234")
    assert lst.search("they Killed someone") and not lst.search("killer")
    assert not lst.search("# a comment")


def test_a_regex_that_does_not_compile_names_its_line(tmp_path):
    path = tmp_path / "list.txt"
    path.write_text("fine\nre:(unclosed\n")
    with pytest.raises(BlocklistError, match=r"list.txt:2"):
        Blocklist.read(path)
    path.write_text("one\nre:tw[o0]\n")
    lst = Blocklist.read(path)
    assert lst.name == "list" and lst.search("TWO") and lst.search("one")


def test_normalize_folds_width_case_accents_and_spacing():
    assert normalize("Ｃafé\u200b  Ｏk") == "cafe ok"


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


def test_the_default_template_is_llama_guard_3s_format():
    from servelm.chat.template import ChatTemplate
    from servelm.service.guard import LLAMA_GUARD_TEMPLATE

    text = ChatTemplate(LLAMA_GUARD_TEMPLATE).render(
        [{"role": "user", "content": "How do I bake bread?"}, {"role": "assistant", "content": "Knead it."}],
        role="Agent", categories=[{"label": lab.label, "name": lab.name} for lab in LLAMA_GUARD_LABELS])
    assert text.startswith("<|start_header_id|>user<|end_header_id|>\n\nTask: Check if there is unsafe content in "
                           "'Agent' messages")
    assert "<BEGIN UNSAFE CONTENT CATEGORIES>\nS1: Violent Crimes.\nS2: Non-Violent Crimes.\n" in text
    assert "S14: Code Interpreter Abuse.\n<END UNSAFE CONTENT CATEGORIES>" in text
    assert "<BEGIN CONVERSATION>\n\nUser: How do I bake bread?\n\nAgent: Knead it.\n\n<END CONVERSATION>" in text
    assert text.endswith("categories.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
