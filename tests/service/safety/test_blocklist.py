"""Term and regex lists: normalization (width, case, accents, spacing, look-alike letters), where a term is found
and where it is not, whole-word terms, phrases, regexes and comments."""

from __future__ import annotations

import pytest

from servelm.service.safety.blocklist import Blocklist, BlocklistError, normalize


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
