"""Decode stays smooth while prompts arrive: a step that decodes reads no more prompt than an inter-token target allows.

A step's wall time is close to linear in what it carries: t ≈ a + b·(decode rows) + c·(prompt tokens), where a is a
step's fixed cost (the loop, a llama_decode call's own), b a decoding row's (its pass, its logits row, its sampling)
and c a prompt token's. The pacer fits a, b and c to the steps just run (least squares, older steps weighing less and
less), and gives a step that decodes d rows the prompt tokens that keep it within the target:
(target − a − b·d) ÷ c, at least `floor` so that a waiting prompt always moves on (and a prompt's whole tiles
a tile at a time, even past it: engine/scheduler.py, which has tiles only where one fits: compose.py). However many
prompts wait, that is all a step reads; one that decodes nothing too (d = 0), unless one tenant alone has prompts
to read (engine/fairness.py: FairShare.paces), whose burst is then read at once and decodes together (the first-token
lead is kept). Work that yields (a priority above 0, such as a batch's lines) fills the decoding rows only up to what
the target holds (rows_within). Until it has seen both kinds of step, or while prompt tokens look free, a step reads at
most UNFIT tokens of prompt. Chunk sizes change no answer: a prompt's cells are the same
however it is cut (docs/exactness.md).
"""

from __future__ import annotations

import numpy as np

FLOOR = 4  # prompt tokens a decoding step may always read, so that prompts move on where decoding alone fills the target
HALF_LIFE = 64  # steps after which an observation weighs half as much
MIN_STEPS = 8  # steps seen with a prompt in them, and without, before the fit is used
UNFIT = 16  # prompt tokens a decoding step may read before the fit is used (64 cost 0.9 s at --threads 1 on 2 cores)


class StepPacer:
    def __init__(self, target_s: float, floor: int = FLOOR) -> None:
        if target_s <= 0:
            raise ValueError("the inter-token target must be positive")
        self.target_s = target_s
        self.floor = floor
        self._decay = 0.5 ** (1 / HALF_LIFE)
        self._xtx = np.eye(3) * 1e-6  # the weighted normal equations of the fit (a tiny ridge keeps them solvable)
        self._xty = np.zeros(3)
        self._with_prompt = 0
        self._without = 0
        self._fit: np.ndarray | None = None

    def observe(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        """One step that ran: its decoding rows (drafted ones included), its prompt tokens, its wall time."""
        if decode_rows + prompt_tokens == 0:
            return
        x = np.array([1.0, decode_rows, prompt_tokens])
        self._xtx = self._xtx * self._decay + np.outer(x, x)
        self._xty = self._xty * self._decay + x * seconds
        if prompt_tokens:
            self._with_prompt += 1
        else:
            self._without += 1
        self._fit = None

    @property
    def costs(self) -> tuple[float, float, float] | None:
        """(a, b, c) in seconds, once enough steps of both kinds were seen; None before."""
        if min(self._with_prompt, self._without) < MIN_STEPS:
            return None
        if self._fit is None:
            self._fit = np.linalg.solve(self._xtx, self._xty)
        a, b, c = (float(v) for v in self._fit)
        return a, b, c

    def prompt_budget(self, decode_rows: int) -> int | None:
        """The prompt tokens a step decoding `decode_rows` rows (0 too) may read within the target."""
        costs = self.costs
        if costs is None or costs[2] <= 0:  # not fitted yet, or on too little variety (prompt tokens look free)
            return UNFIT
        a, b, c = costs
        room = self.target_s - max(a, 0.0) - max(b, 0.0) * decode_rows
        return max(self.floor, int(room / c))

    def rows_within(self) -> int | None:
        """The decoding rows a step may carry within the target (None: no fit yet, or rows that look free)."""
        costs = self.costs
        if costs is None or costs[1] <= 0:
            return None
        a, b, _ = costs
        return max(1, int((self.target_s - max(a, 0.0)) / b))
