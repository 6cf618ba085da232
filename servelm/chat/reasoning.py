"""Reasoning output: a model that thinks writes `<think>…</think>` (or a deployment's own pair of markers) before
its answer. The parser splits a choice's text, as it streams, into the thought and the answer.

The thought begins where the output opens it (leading whitespace aside) or, when the prompt already opened it
(a template that writes the opening marker into the generation prompt), at the output's first character. It ends
at the closing marker; everything after is the answer. A marker split across tokens is held back until it is
whole; text that cannot begin a marker goes out at once.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK = ("<think>", "</think>")


@dataclass(frozen=True)
class ReasoningMarkers:
    open: str
    close: str

    @classmethod
    def parse(cls, value: str) -> ReasoningMarkers:
        """"<think>,</think>": the opening and the closing marker."""
        parts = [p.strip() for p in value.split(",")]
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"reasoning markers are written 'OPEN,CLOSE' (e.g. '<think>,</think>'); got {value!r}")
        return cls(parts[0], parts[1])


class ReasoningParser:
    """feed() a choice's text as it comes; each call returns (thought, answer) text that is now certain."""

    def __init__(self, markers: ReasoningMarkers, opened: bool) -> None:
        self.markers = markers
        self.state = "thinking" if opened else "start"  # start → thinking → answer (or start → answer)
        self._held = ""
        # what a section that has just begun drops from its front: the line break after an opening marker the
        # output wrote (a thought the prompt opened is taken whole: the engine counts its every token)
        self._trim = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        thought = answer = ""
        while self._held:
            if self.state == "start":
                head = self._held.lstrip()
                if head.startswith(self.markers.open):
                    self._held = head[len(self.markers.open):]
                    self.state, self._trim = "thinking", "\n"
                    continue
                if head and not self.markers.open.startswith(head) or len(head) >= len(self.markers.open):
                    self.state = "answer"  # no thought
                    continue
                return thought, answer  # whitespace, or part of the opening marker: wait
            if self._trim:
                self._held = self._held.lstrip(self._trim)
                if not self._held:
                    return thought, answer
                self._trim = ""
            if self.state == "thinking":
                i = self._held.find(self.markers.close)
                if i >= 0:
                    thought += self._held[:i]
                    self._held = self._held[i + len(self.markers.close):]
                    self.state, self._trim = "answer", " \t\r\n"
                    continue
                keep = _partial_suffix(self._held, self.markers.close)
                thought += self._held[: len(self._held) - keep]
                self._held = self._held[len(self._held) - keep:]
                return thought, answer
            if self.state == "answer":
                answer += self._held
                self._held = ""
        return thought, answer

    def finish(self) -> tuple[str, str]:
        """The text still held at the end: an unfinished thought stays a thought."""
        held, self._held = self._held, ""
        if self.state == "thinking":
            return held, ""
        return "", held if self.state == "answer" or held.strip() else ""

    @property
    def answering(self) -> bool:
        return self.state == "answer"


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (what may be a marker cut in two)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def split_reasoning(markers: ReasoningMarkers, opened: bool, text: str) -> tuple[str, str]:
    """A whole choice's text → (thought, answer)."""
    parser = ReasoningParser(markers, opened)
    thought, answer = parser.feed(text)
    more_thought, more_answer = parser.finish()
    return thought + more_thought, answer + more_answer
