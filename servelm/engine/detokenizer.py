"""Incremental detokenizing: token bytes in, safe text out, with stop strings found across tokens.

Bytes are decoded with an incremental UTF-8 decoder, so a character split over several tokens is sent
only when complete. Text that could be the start of a stop string is held back until it is clear
either way, so a stream never shows part of a stop string.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable


class Detokenizer:
    def __init__(self, token_bytes: Callable[[int], bytes], stop: tuple[str, ...] = (), *,
                 include_stop: bool = False) -> None:
        self._token_bytes = token_bytes
        self._include_stop = include_stop
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(s for s in stop if s)
        self._held = ""  # decoded, not yet sent

    def push(self, token: int) -> tuple[str, str | None]:
        """Add one token; return (text now safe to send, the stop string matched or None)."""
        self._held += self._decoder.decode(self._token_bytes(token))
        if not self._stop:
            out, self._held = self._held, ""
            return out, None
        hit, at = self._find_stop()
        if hit is not None:
            out, self._held = self._held[: at + len(hit) if self._include_stop else at], ""
            return out, hit
        keep = self._partial_stop_suffix()
        cut = len(self._held) - keep
        out, self._held = self._held[:cut], self._held[cut:]
        return out, None

    def flush(self) -> str:
        """The generation ended without a stop string: release everything held back."""
        out = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return out

    def _find_stop(self) -> tuple[str | None, int]:
        best: tuple[str | None, int] = (None, -1)
        for s in self._stop:
            i = self._held.find(s)
            if i >= 0 and (best[0] is None or i < best[1]):
                best = (s, i)
        return best

    def _partial_stop_suffix(self) -> int:
        """Length of the longest tail of the held text that begins some stop string."""
        held = self._held
        longest = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(held)), longest, -1):
                if held.endswith(s[:k]):
                    longest = k
                    break
        return longest
