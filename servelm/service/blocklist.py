"""Term and regex blocklists (a content filter's lists): one entry a line, `re:` before a regular expression,
`#` before a comment. Text and terms are compared after the same normalization, so that case, accents, width,
ligatures, zero-width characters, spacing and letters of other scripts that look Latin do not slip a term
through: `ＢＡＤ`, `bàd`, `b\u200bad`, `b4d` and Cyrillic `bаd` all read as `bad`."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
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


def fold(text: str) -> str:
    """Text as regexes read it: compatibility forms folded (NFKC: full width, ligatures), accents and invisible
    format characters dropped, case folded, runs of white space as one space."""
    decomposed = unicodedata.normalize("NFKD", text)
    kept = "".join(c for c in decomposed if unicodedata.category(c) not in ("Mn", "Cf"))
    return _SPACES.sub(" ", unicodedata.normalize("NFKC", kept).casefold())


def normalize(text: str) -> str:
    """Text as terms compare it: folded, and look-alike letters and digits read as the Latin letter they
    imitate."""
    return fold(text).translate(_LOOKALIKES)


class BlocklistError(ValueError):
    """A list that cannot be read: a regex that does not compile (named by its line)."""


class Blocklist:
    """One named list. Terms match as whole words (not inside a longer word) wherever they begin and end with a
    letter or digit, in the normalized text; `re:` entries are searched as written, case-insensitive, in the folded
text (so `\\d` still means a digit)."""

    def __init__(self, entries: Iterable[str], name: str = "blocklist", source: str = "") -> None:
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
                term = re.escape(normalize(line).strip())
                if term:
                    start = r"(?<!\w)" if line[0].isalnum() else ""
                    end = r"(?!\w)" if line[-1].isalnum() else ""
                    terms.append(f"{start}{term}{end}")
        self._terms = re.compile("|".join(sorted(terms, key=len, reverse=True))) if terms else None
        self._regexes = re.compile("|".join(patterns), re.IGNORECASE) if patterns else None
        self.size = len(terms) + len(patterns)

    @classmethod
    def read(cls, path: Path, name: str | None = None) -> Blocklist:
        text = Path(path).read_text(encoding="utf-8")
        return cls(text.splitlines(), name or Path(path).stem, str(path))

    def search(self, text: str) -> bool:
        """Whether the (raw) text holds an entry."""
        if self._regexes is not None and self._regexes.search(fold(text)):
            return True
        return self._terms is not None and self._terms.search(normalize(text)) is not None
