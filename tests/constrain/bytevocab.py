"""A byte-level vocabulary for grammar tests: token 0 is EOS, token b+1 is the single byte b."""

from __future__ import annotations

from servelm.constrain.grammars import Grammars

EOS = 0
TABLE = [b"\xff<eos>"] + [bytes([b]) for b in range(256)]


def tokens(text: str) -> list[int]:
    return [b + 1 for b in text.encode("utf-8")]


def grammars() -> Grammars:
    return Grammars(TABLE, [EOS], lambda data: [b + 1 for b in data])


def accepts(g: Grammars, constraint, text: str) -> bool:
    """Whether the constraint's grammar takes exactly this text and then may end."""
    m = g.matcher(constraint)
    for t in tokens(text):
        if not m.consume_token(t):
            return False
    return m.is_accepting()
