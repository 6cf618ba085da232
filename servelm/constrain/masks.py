"""Token masks for one step: every constrained row's allowed tokens, computed together.

llguidance writes one bit per token; numpy unpacks the bits into a boolean row per matcher. The work
is proportional to the constrained rows only: unconstrained rows in the same batch never wait on it.
Masks are computed on the engine thread one after another (about 0.1 ms each): a thread pool would
only contend with llama.cpp's own threads for the same cores.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from llguidance import LLMatcher


class MaskComputer:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._bits = np.zeros((0, self._words), dtype=np.int32)

    def allowed(self, matchers: Sequence[LLMatcher]) -> np.ndarray:
        """A (len(matchers) × vocab) boolean array: True where the matcher's grammar allows the token."""
        k = len(matchers)
        if self._bits.shape[0] < k:
            self._bits = np.zeros((max(k, 2 * self._bits.shape[0]), self._words), dtype=np.int32)
        bits = self._bits[:k]
        row_bytes = self._words * 4
        base = bits.ctypes.data
        for i, m in enumerate(matchers):
            m.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)
        unpacked = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
        return unpacked[:, : self.vocab_size].view(bool)
