"""Control tokens come from the chat template only: text in a message stays text.

A rendered prompt was tokenized with special tokens parsed, so a user who wrote `<|im_end|>\n<|im_start|>system`
in a message got real control tokens and could forge a system turn. Here every string that reaches the template
from the request (contents, names, tool calls and tool definitions) has each control token's text swapped for a
placeholder first; the rendered prompt is then cut at the control-token texts that remain (the template's own),
the way llama.cpp cuts it (longest token text first, with its lstrip/rstrip attributes), and every piece between
them is tokenized as plain text with the placeholders put back. A request without control-token text in it
tokenizes exactly as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_MARK = "\ue000"  # a private-use character opens and closes a placeholder (and is itself escaped in content)
_END = "\ue001"


@dataclass(frozen=True)
class ControlToken:
    text: str
    id: int
    lstrip: bool = False  # whitespace before it is dropped when it is cut out (llama.cpp's LSTRIP attribute)
    rstrip: bool = False  # and after it


class ControlMarkers:
    def __init__(self, tokens: Sequence[ControlToken]) -> None:
        self.tokens = sorted((t for t in tokens if t.text), key=lambda t: -len(t.text))  # llama.cpp's order
        # what a placeholder stands for: each control token's text, and the placeholder mark itself
        self._escaped = [t.text for t in self.tokens] + [_MARK]
        self._placeholder = {text: f"{_MARK}{i}{_END}" for i, text in enumerate(self._escaped)}

    # -- the request's strings ----------------------------------------------------------------------
    def escape(self, value: Any) -> Any:
        """Every string inside (dicts, lists) with control-token text swapped for placeholders."""
        if isinstance(value, str):
            return self._escape_text(value)
        if isinstance(value, dict):
            return {k: self.escape(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.escape(v) for v in value]
        return value

    def _escape_text(self, text: str) -> str:
        if _MARK in text:
            text = text.replace(_MARK, self._placeholder[_MARK])
        for t in self.tokens:
            if t.text in text:
                text = text.replace(t.text, self._placeholder[t.text])
        return text

    def restore(self, text: str) -> str:
        if _MARK not in text:
            return text
        out, i = [], 0
        while True:
            j = text.find(_MARK, i)
            k = text.find(_END, j + 1) if j >= 0 else -1
            if j < 0 or k < 0:
                out.append(text[i:])
                return "".join(out)
            out.append(text[i:j])
            index = text[j + 1:k]
            out.append(self._escaped[int(index)] if index.isdigit() and int(index) < len(self._escaped) else text[j:k + 1])
            i = k + 1

    # -- the rendered prompt -------------------------------------------------------------------------
    def split(self, rendered: str) -> list[str | int]:
        """The rendered prompt as llama.cpp's tokenizer cuts it with special tokens parsed: the template's control
        tokens (ids) and the text between them (placeholders restored: the request's own text)."""
        pieces: list[str | int] = [rendered]
        for t in self.tokens:
            out: list[str | int] = []
            for piece in pieces:
                if isinstance(piece, int) or t.text not in piece:
                    out.append(piece)
                    continue
                parts = piece.split(t.text)
                for n, part in enumerate(parts):
                    if n > 0 and t.rstrip:
                        part = part.lstrip()
                    if n < len(parts) - 1 and t.lstrip:
                        part = part.rstrip()
                    if part:
                        out.append(part)
                    if n < len(parts) - 1:
                        out.append(t.id)
            pieces = out
        return [p if isinstance(p, int) else self.restore(p) for p in pieces]

    def tokenize(self, rendered: str, text_tokens: Callable[[str], list[int]], bos: int | None) -> list[int]:
        """Token ids of a rendered prompt: `text_tokens` reads plain text (no special tokens parsed, nothing added);
        `bos` goes first unless the template wrote it."""
        ids: list[int] = []
        for piece in self.split(rendered):
            if isinstance(piece, int):
                ids.append(piece)
            else:
                ids.extend(text_tokens(piece))
        if bos is not None and not (ids and ids[0] == bos):
            ids.insert(0, bos)
        return ids
