"""Term and regex blocklists (a content filter's lists): one entry a line, `re:` before a regular expression,
`word:` before a term matched as a whole word only, `#` before a comment. Text and terms are compared after the
same normalization, so that case, accents, width, ligatures, zero-width characters, spacing and characters that
look like Latin letters do not slip a term through: `ＢＡＤ`, `bàd`, `b\u200bad`, `b4d`, Cyrillic `bаd`, small
capitals `ʙᴀᴅ` and a dotless `ı` all read as Latin letters. Look-alikes come from Unicode's confusables data (UTS
#39, as the confusable-homoglyphs package ships it) and the character database's small capitals and modifier
letters.

A term is found wherever it stands in the normalized text, glued to letters, digits, underscores or itself
(`xbadx`, `_bad_`, `badbadbad`): a list meant to stop a word stops it inside longer ones too, at the price of
blocking words that merely contain it (`bad` in `badge`). `word:bad`, or a list's `whole_words`, matches whole
words only, which a glued spelling then slips past."""

from __future__ import annotations

import json
import re
import sys
import unicodedata
from collections.abc import Iterable
from functools import cache
from importlib.resources import files
from pathlib import Path

# Letters of other scripts that render like Latin ones (Cyrillic and Greek), read as the Latin letter. After
# casefolding, so lower case only.
_LOOKALIKES = str.maketrans({
    "а": "a", "в": "b", "е": "e", "ё": "e", "к": "k", "м": "m", "н": "h", "о": "o", "р": "p", "с": "c", "т": "t",
    "у": "y", "х": "x", "ѕ": "s", "і": "i", "ї": "i", "ј": "j", "ԁ": "d", "ԛ": "q", "ԝ": "w", "һ": "h", "ү": "y",
    "α": "a", "β": "b", "ε": "e", "η": "n", "ι": "i", "κ": "k", "ν": "v", "ο": "o", "ρ": "p", "τ": "t", "υ": "u",
    "χ": "x", "ω": "w",
    "0": "o", "1": "l", "3": "e", "4": "a", "5": "s", "7": "t", "@": "a", "$": "s",
})
_SPACES = re.compile(r"\s+")
# Unicode's Default_Ignorable_Code_Point (DerivedCoreProperties.txt): characters that render as nothing, some of
# them letters (the Hangul fillers) rather than format characters; and the blank Braille pattern, which renders
# as a blank. Dropped, so that none of them splits a term.
_INVISIBLE = re.compile("[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u202a-\u202e"
                        "\u2060-\u206f\u2800\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufff8\U0001bca0-\U0001bca3"
                        "\U0001d173-\U0001d17a\U000e0000-\U000e0fff]")


def fold(text: str) -> str:
    """Text as regexes read it: compatibility forms folded (NFKC: full width, ligatures), accents, invisible
    format characters and every character that renders as nothing dropped, case folded, runs of white space as
    one space."""
    decomposed = _INVISIBLE.sub("", unicodedata.normalize("NFKD", text))
    kept = "".join(c for c in decomposed if unicodedata.category(c) not in ("Mn", "Cf"))
    return _SPACES.sub(" ", unicodedata.normalize("NFKC", kept).casefold())


_NAMED = re.compile(r"LATIN (?:LETTER SMALL CAPITAL|SMALL LETTER DOTLESS|LETTER SMALL|SMALL CAPITAL LETTER) ([A-Z])"
                    r"|MODIFIER LETTER (?:SMALL|CAPITAL) ([A-Z])")


@cache
def _confusables() -> dict[int, str]:
    """Every character that looks like a Latin letter or digit, as that letter (lower case): Unicode's confusables
    (UTS #39), followed one step further where they lead to another look-alike, and the character database's small
    capitals, dotless letters and modifier letters by name."""
    data = json.loads(files("confusable_homoglyphs").joinpath("confusables.json").read_text(encoding="utf-8"))

    def latin(c: str) -> str | None:
        low = c.casefold()
        return low if len(low) == 1 and low.isascii() and low.isalnum() else None

    table: dict[int, str] = {}
    for char, entries in data.items():
        if len(char) != 1 or latin(char):
            continue
        targets = [e["c"] for e in entries] + [f["c"] for e in entries for f in data.get(e["c"], ())]
        found = next((t for t in map(latin, targets) if t), None)
        if found:
            table[ord(char)] = found
    for code in range(0x80, sys.maxunicode + 1):
        m = _NAMED.fullmatch(unicodedata.name(chr(code), ""))
        if m:
            table.setdefault(code, (m.group(1) or m.group(2)).lower())
    table.update(_LOOKALIKES)
    return table


def normalize(text: str) -> str:
    """Text as terms compare it: folded, and look-alike characters read as the Latin letter they imitate."""
    return fold(text).translate(_confusables())


class BlocklistError(ValueError):
    """A list that cannot be read: a regex that does not compile (named by its line)."""


class Blocklist:
    """One named list. Terms are found anywhere in the normalized text (`word:` ones, or all with `whole_words`, as
    whole words where they begin and end with a letter or digit); `re:` entries are searched as written,
    case-insensitive, in the folded text (so `\\d` still means a digit)."""

    def __init__(self, entries: Iterable[str], name: str = "blocklist", source: str = "",
                 whole_words: bool = False) -> None:
        self.name = name
        terms: list[str] = []
        patterns: list[str] = []
        for n, raw in enumerate(entries, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("re:"):
                try:
                    re.compile(line[3:])
                except re.error as exc:
                    where = f"{source}:{n}" if source else f"entry {n}"
                    raise BlocklistError(f"{where}: the regular expression {line[3:]!r} does not compile: {exc}") from None
                patterns.append(f"(?:{line[3:]})")
            else:
                whole = whole_words or line.startswith("word:")
                line = line.removeprefix("word:").strip()
                term = re.escape(normalize(line).strip())
                if term:
                    start = r"(?<!\w)" if whole and line[0].isalnum() else ""
                    end = r"(?!\w)" if whole and line[-1].isalnum() else ""
                    terms.append(f"{start}{term}{end}")
        self._terms = re.compile("|".join(sorted(terms, key=len, reverse=True))) if terms else None
        self._regexes = re.compile("|".join(patterns), re.IGNORECASE) if patterns else None
        self.size = len(terms) + len(patterns)

    @classmethod
    def read(cls, path: Path, name: str | None = None, whole_words: bool = False) -> Blocklist:
        text = Path(path).read_text(encoding="utf-8")
        return cls(text.splitlines(), name or Path(path).stem, str(path), whole_words)

    def search(self, text: str) -> bool:
        """Whether the (raw) text holds an entry."""
        if self._regexes is not None and self._regexes.search(fold(text)):
            return True
        return self._terms is not None and self._terms.search(normalize(text)) is not None
