"""One sequence's thought, as the engine sees it: whether it is inside `open … close`, how many tokens it has
spent there, and, once a budget is spent, the closing marker's tokens it must write next (the sampler is masked to
each in turn). Bytes, not text: a marker may end in the middle of a character's tokens."""

from __future__ import annotations

from servelm.engine.types import Thinking


class ThinkTracker:
    def __init__(self, spec: Thinking) -> None:
        self.spec = spec
        self.state = "start"  # start → thinking → (forcing →) done; start → done when the output does not think
        self.tokens = 0  # generated while thinking, the closing marker's tokens included
        self.forced: list[int] = []  # the closing marker's tokens still to write
        self._tail = b""
        if spec.opened:
            self._enter()

    @property
    def reasoning_tokens(self) -> int:
        """The thought's tokens, its closing marker left out."""
        if self.state == "done" and self.tokens:
            return max(0, self.tokens - len(self.spec.close_ids))
        return self.tokens

    def step(self, token: int, text: bytes) -> None:
        if self.state == "done":
            return
        if self.state == "forcing":
            self.tokens += 1
            self.forced.pop(0)
            if not self.forced:
                self.state = "done"
            return
        self._tail = (self._tail + text)[-(len(self.spec.open) + len(self.spec.close) + 64):]
        if self.state == "start":
            head = self._tail.lstrip()
            if head.startswith(self.spec.open):
                self._tail = head[len(self.spec.open):]
                self._enter()
            elif head and not self.spec.open.startswith(head):
                self.state = "done"  # the answer, without a thought
            return
        self.tokens += 1
        if self.spec.close in self._tail:
            self.state = "done"
            return
        self._check_budget()

    def _enter(self) -> None:
        self.state = "thinking"
        self._check_budget()

    def _check_budget(self) -> None:
        if self.spec.budget is not None and self.tokens >= self.spec.budget and self.spec.close_ids:
            self.state = "forcing"
            self.forced = list(self.spec.close_ids)
