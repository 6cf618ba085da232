"""Attacks on the content filter's term lists: characters that render as nothing, inside a term.

A term split by U+3164 HANGUL FILLER passed: it is a letter (Lo), not a format character, so it was kept. Every
default-ignorable code point (Unicode's Default_Ignorable_Code_Point: fillers, variation selectors, tags, bidi
controls, the Mongolian free variation selectors) and the blank Braille pattern now read as nothing.
"""

from __future__ import annotations

import pytest

from servelm.service.safety.blocklist import Blocklist

INVISIBLE = ["\u3164", "\u115f", "\u1160", "\uffa0", "\u2800", "\u180e", "\u180b", "\ufe0f", "\U000e0020",
             "\U000e0101", "\u2066", "\u202e", "\u061c", "\u17b4", "\U0001d173", "\U0001bca0", "\u034f", "\u2064"]


@pytest.mark.parametrize("filler", INVISIBLE, ids=[f"U+{ord(c):04X}" for c in INVISIBLE])
def test_a_term_split_by_a_character_that_renders_as_nothing_is_caught(filler):
    assert Blocklist(["forbiddenword"]).search(f"say forbid{filler}denword now")
    assert Blocklist(["forbiddenword"]).search(filler.join("forbiddenword"))


def test_visible_separators_still_split_a_term():
    assert not Blocklist(["forbiddenword"]).search("forbid denword")
    assert not Blocklist(["forbiddenword"]).search("forbid\u3131denword")  # a real Hangul letter
